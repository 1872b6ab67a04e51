"""Topics as producers and consumers see them: creation, lookup and auto-creation.

Theory of operation: the store keeps the topic table (`MessageStore.topics`, persisted in the
`topics` file); this room holds the rules about it that are the broker's: a user may not create a
system topic, queue counts and message types are checked, and with `auto_create_topics` a topic
is created by the first message *accepted* to it (`for_send` returns what auto-create would make
without making it, so a refused message leaves no topic behind; `ensure` makes it once the
message is on its way to the log). A consumer never creates a topic (`for_receive`). Takes
`now_ms` from the clock it is given; no I/O of its own.

Near names. Auto-creation turns a typo into a topic: a send to `ordres` while `orders` exists
would create `ordres`, and the consumers of `orders` would never see the message. So a send to a
missing topic whose name is *near* an existing one's is refused (`TopicNameTooNear`, 40402,
naming the near topics), unless the sender asked for the topic (`create_near`: the CLI's
`send --create-topic`, the SDK's `create_topics=True`, admin SendBatch's `create_topic`) or the
server allows it (`auto_create_topic_near_names`). A name near none is auto-created as before.
Every door reaches this rule through `for_send`; a refused send creates and stores nothing. A
consumer of a missing topic, and any lookup that finds none, is told the near topics too
(`TopicNotFound.candidates`: "did you mean 'orders'?").

The rule (`near_names`), on case-folded names: two different names are near when
- they differ only in case (`Orders`, `orders`); or
- their numbers are the same (the runs of digits, in order: `shard-1` and `shard-2` are a series,
  not a typo, and neither are `orders` and `orders2`), they are not siblings (alike but for one
  whole word of one or two characters, words ending at a separator or where lower case turns
  upper: `orders-eu` and `orders-us`, `topic-a` and `topic-b`, `topicA` and `topicB` name a set,
  as regions or shards do), and their Damerau-Levenshtein distance (optimal string alignment:
  an insertion, deletion, substitution or swap of two neighbours counts one) is at most 2 when
  the shorter name has 5 characters or more, at most 1 when it has 3 or 4; a name of 1 or 2
  characters is near only another spelling of itself in other case (one edit turns one into
  dozens of others: a suggestion would be noise).
System topics are never suggested. Candidates come sorted by distance, then name, at most
`MAX_NEAR_NAMES`. The distance is computed here, in a few lines, rather than by a library
(rapidfuzz would be a compiled dependency for one function): it runs only for a name that is not
a topic, over the user's topics, only within the limit of the diagonal.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from chronoq.clock import Clock
from chronoq.config import Config
from chronoq.errors import (
    InvalidQueueCount,
    MessageTypeNotAccepted,
    SystemTopicForbidden,
    TopicNameTooNear,
    TopicNotFound,
)
from chronoq.model import ALL_MESSAGE_TYPES, MessageType, TopicConfig, is_system_topic
from chronoq.store.messagestore import MessageStore
from chronoq.validate import check_topic_name

MAX_NEAR_NAMES = 5
"""Most near topics an error names: enough to choose from, and a refusal stays one line."""
_DIGITS = re.compile(r"[0-9]+")
_SEPARATORS = re.compile(r"([^0-9a-z]+)")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
SIBLING_SEGMENT_CHARS = 2
"""A segment this short that alone tells two names apart marks siblings (`orders-eu`, `orders-us`)."""


def max_distance(length: int) -> int:
    """The most edits two names may differ by when the shorter has `length` characters."""
    return 2 if length >= 5 else 1 if length >= 3 else 0


def edit_distance(a: str, b: str, limit: int) -> int | None:
    """The optimal-string-alignment distance between `a` and `b` (insertions, deletions,
    substitutions, swaps of neighbours: one each), or None when it is more than `limit`. Only
    cells within `limit` of the diagonal are computed; a row whose every cell is past the limit
    ends the search (a row's minimum never falls)."""
    n, m = len(a), len(b)
    if abs(n - m) > limit:
        return None
    over = limit + 1
    before: list[int] = []
    prev = [min(j, over) for j in range(m + 1)]
    for i in range(1, n + 1):
        row = [min(i, over)] + [over] * m
        low = row[0]
        ai = a[i - 1]
        for j in range(max(1, i - limit), min(m, i + limit) + 1):
            bj = b[j - 1]
            d = prev[j - 1] if ai == bj else prev[j - 1] + 1
            if prev[j] + 1 < d:
                d = prev[j] + 1
            if row[j - 1] + 1 < d:
                d = row[j - 1] + 1
            if i > 1 and j > 1 and ai == b[j - 2] and a[i - 2] == bj and before[j - 2] + 1 < d:
                d = before[j - 2] + 1
            row[j] = d if d < over else over
            if d < low:
                low = d
        if low > limit:
            return None
        before, prev = prev, row
    return prev[m] if prev[m] <= limit else None


def segments(name: str) -> list[str]:
    """`name` case-folded and cut into words and the separators between them (characters other
    than letters and digits; a change from lower case to upper case cuts too): words at even
    places, separators at odd ones."""
    return _SEPARATORS.split(_CAMEL.sub("-", name).casefold())


def siblings(a: str, b: str) -> bool:
    """Whether `a` and `b` are alike but for one whole word (`segments`) of at most
    `SIBLING_SEGMENT_CHARS` characters."""
    parts_a, parts_b = segments(a), segments(b)
    if len(parts_a) != len(parts_b):
        return False
    differ = [i for i, (x, y) in enumerate(zip(parts_a, parts_b, strict=True)) if x != y]
    if len(differ) != 1 or differ[0] % 2:  # split() puts the separators at odd places
        return False
    x, y = parts_a[differ[0]], parts_b[differ[0]]
    return 0 < len(x) <= SIBLING_SEGMENT_CHARS and 0 < len(y) <= SIBLING_SEGMENT_CHARS


def near_names(name: str, names: Iterable[str]) -> list[str]:
    """The names among `names` near `name` (the module's rule), nearest first, then by name; at
    most `MAX_NEAR_NAMES`. `name` itself and system topics are never among them."""
    folded = name.casefold()
    numbers = _DIGITS.findall(folded)
    found: list[tuple[int, str]] = []
    for other in names:
        if other == name or is_system_topic(other):
            continue
        other_folded = other.casefold()
        if other_folded == folded:
            found.append((0, other))
            continue
        if _DIGITS.findall(other_folded) != numbers or siblings(name, other):
            continue
        d = edit_distance(folded, other_folded, max_distance(min(len(folded), len(other_folded))))
        if d is not None:
            found.append((d, other))
    return [other for _, other in sorted(found)[:MAX_NEAR_NAMES]]


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
        """The topic `name`; `TopicNotFound` naming the near topics when there is none."""
        topic = self.store.topics.get(name)
        if topic is None:
            raise TopicNotFound(name, candidates=self.near(name))
        return topic

    def list(self) -> list[TopicConfig]:
        """The user's topics (system topics left out), by name."""
        return sorted((t for t in self.store.topics.values() if not is_system_topic(t.name)), key=lambda t: t.name)

    def near(self, name: str) -> list[str]:
        """The existing topics whose names are near `name` (`near_names`)."""
        return near_names(name, self.store.topics)

    def for_send(self, name: str, *, create_near: bool = False) -> TopicConfig:
        """The topic a message to `name` goes to: the existing one, or (auto-create on) the one
        `ensure` would make, not made yet. A missing name near an existing topic's is refused
        (`TopicNameTooNear`) unless `create_near` or `auto_create_topic_near_names`."""
        topic = self.store.topics.get(name)
        if topic is not None:
            return topic
        if not self.config.auto_create_topics:
            raise TopicNotFound(name, auto_create=False, candidates=self.near(name))
        if not (create_near or self.config.auto_create_topic_near_names):
            near = self.near(name)
            if near:
                raise TopicNameTooNear(name, near)
        return TopicConfig(name, self.config.default_queue_count, ALL_MESSAGE_TYPES, self.clock.now_ms())

    def for_receive(self, name: str) -> TopicConfig:
        """The topic a consumer reads: it must exist. A consumer never creates one, so a
        mistyped name does not appear as a topic (the error names the near topics). The timer
        and schedule topics hold messages not due yet: a consumer of them would get a timer
        early (and again when it fires)."""
        if is_system_topic(name):
            raise SystemTopicForbidden(name, receive=True)
        topic = self.store.topics.get(name)
        if topic is None:
            raise TopicNotFound(name, auto_create=self.config.auto_create_topics, candidates=self.near(name))
        return topic

    def ensure(self, name: str) -> TopicConfig:
        """The topic `name`, created with the defaults if it is missing and auto-create is on
        (`for_send` has judged the name: this creates what it allowed)."""
        topic = self.store.topics.get(name)
        if topic is not None:
            return topic
        if not self.config.auto_create_topics:
            raise TopicNotFound(name, auto_create=False)
        return self.store.create_topic(name, self.config.default_queue_count, ALL_MESSAGE_TYPES,
                                       self.clock.now_ms(), exist_ok=True)
