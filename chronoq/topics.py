"""Topics as producers and consumers see them: creation, lookup and auto-creation.

Theory of operation: the store keeps the topic table (`MessageStore.topics`, persisted in the
`topics` file); this room holds the rules about it that are the broker's: a user may not create a
system topic, queue counts and message types are checked, and with `auto_create_topics` a topic
is created by the first message *accepted* to it (`for_send` returns what auto-create would make
without making it, so a refused message leaves no topic behind; `ensure` makes it once the
message is on its way to the log). A consumer never creates a topic (`for_receive`). Takes
`now_ms` from the clock it is given; no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from chronoq.clock import Clock
from chronoq.config import Config
from chronoq.errors import InvalidQueueCount, MessageTypeNotAccepted, SystemTopicForbidden, TopicNotFound
from chronoq.model import ALL_MESSAGE_TYPES, MessageType, TopicConfig, is_system_topic
from chronoq.store.messagestore import MessageStore
from chronoq.validate import check_topic_name


class Topics:
    def __init__(self, config: Config, store: MessageStore, clock: Clock) -> None:
        self.config = config
        self.store = store
        self.clock = clock

    def create(self, name: str, queue_count: int | None = None,
               message_types: Iterable[MessageType] | None = None) -> TopicConfig:
        check_topic_name(name, self.config)
        if is_system_topic(name):
            raise SystemTopicForbidden(name)
        count = self.config.default_queue_count if queue_count is None else queue_count
        if not isinstance(count, int) or not 1 <= count <= self.config.max_queue_count:
            raise InvalidQueueCount(count, self.config.max_queue_count)
        types = frozenset(MessageType(t) for t in message_types) if message_types is not None else ALL_MESSAGE_TYPES
        if not types:
            raise MessageTypeNotAccepted(name, "any", [])
        return self.store.create_topic(name, count, types, self.clock.now_ms())

    def get(self, name: str) -> TopicConfig:
        return self.store.get_topic(name)

    def list(self) -> list[TopicConfig]:
        """The user's topics (system topics left out), by name."""
        return sorted((t for t in self.store.topics.values() if not is_system_topic(t.name)), key=lambda t: t.name)

    def for_send(self, name: str) -> TopicConfig:
        """The topic a message to `name` goes to: the existing one, or (auto-create on) the one
        `ensure` would make, not made yet."""
        topic = self.store.topics.get(name)
        if topic is not None:
            return topic
        if not self.config.auto_create_topics:
            raise TopicNotFound(name, auto_create=False)
        return TopicConfig(name, self.config.default_queue_count, ALL_MESSAGE_TYPES, self.clock.now_ms())

    def for_receive(self, name: str) -> TopicConfig:
        """The topic a consumer reads: it must exist. A consumer never creates one, so a
        mistyped name does not appear as a topic. The timer and schedule topics hold messages
        not due yet: a consumer of them would get a timer early (and again when it fires)."""
        if is_system_topic(name):
            raise SystemTopicForbidden(name, receive=True)
        topic = self.store.topics.get(name)
        if topic is None:
            raise TopicNotFound(name, auto_create=self.config.auto_create_topics)
        return topic

    def ensure(self, name: str) -> TopicConfig:
        """The topic `name`, created with the defaults if it is missing and auto-create is on."""
        topic = self.store.topics.get(name)
        if topic is not None:
            return topic
        if not self.config.auto_create_topics:
            raise TopicNotFound(name, auto_create=False)
        return self.store.create_topic(name, self.config.default_queue_count, ALL_MESSAGE_TYPES,
                                       self.clock.now_ms(), exist_ok=True)
