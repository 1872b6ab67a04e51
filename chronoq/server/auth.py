"""Who may do what: the `[auth]` configuration, authentication of a call, and permission checks.

Theory of operation: the broker knows a table of users, read at start from the server's TOML
(`[auth]` and `[[auth.users]]`, `load_auth`) and read again on SIGHUP (`Authenticator.reload`:
a table that does not load is refused whole, and the one in use stays). Each user has an access key and a
secret key (RocketMQ ACL 2.0's credentials, so the official clients work unmodified), the topics
it may publish to and subscribe to (names or shell-style globs: `payments-*`), the consumer groups
it may consume as, and an `admin` flag. An admin may do everything.

Every call, on both services, is authenticated first, from its own metadata (`Authenticator
.authenticate`): the signed headers are read by `chronoq.protocol.signature` (the wire rule), the
access key is looked up, the signature checked in constant time, and the date checked against the
server's wall clock within `max_time_skew_s`. A streaming call (Telemetry, a long-polling
ReceiveMessage) is authenticated once, when it opens: its metadata is sent once. The result is a
`Principal`, which the services ask before they act (`require_publish`, `require_subscribe`,
`require_admin`...), so a refusal changes nothing. With auth off (the default, for the embedded
demo and tests) every call gets `ANONYMOUS`, which may do everything, and headers are ignored.
A refused call is logged (`RefusalLog`): one WARNING line per peer, RPC and reason a minute.

The replay window (`max_time_skew_s`, default one day) is chronoq's choice; RocketMQ checks none.
The signature covers only the date, never the request, so anyone who sees one header on the wire
can reuse it with any request until the window closes: the window bounds that, TLS prevents it.
It cannot be minutes: the Python and Go clients stamp *local* time with a literal `Z`, so a
client in UTC+14 or UTC-12 sends a date that far from UTC; one day covers every zone plus clock
skew. 0 turns the check off (RocketMQ's behaviour).

The auth room owns no clock: the server passes `now_ms` (the wall clock; a freshness check is
about the client's wall clock, not the broker's step-proof time).
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import re
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chronoq.config import ConfigError, toml_text
from chronoq.errors import ChronoqError, Forbidden, Unauthorized
from chronoq.protocol import signature

DEFAULT_MAX_TIME_SKEW_S = 24 * 60 * 60
"""One day: the widest time zone offset (14 h) of clients that stamp local time as UTC, plus skew."""
MAX_KEY_CHARS = 256


@dataclass(frozen=True, slots=True)
class User:
    access_key: str
    secret_key: str
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    admin: bool = False


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """`enabled` false (the default): no call is authenticated or refused."""

    enabled: bool = False
    users: tuple[User, ...] = ()
    max_time_skew_s: int = DEFAULT_MAX_TIME_SKEW_S

    def __post_init__(self) -> None:
        if isinstance(self.max_time_skew_s, bool) or not isinstance(self.max_time_skew_s, int) \
                or self.max_time_skew_s < 0:
            raise ConfigError(f"auth.max_time_skew_s must be an integer >= 0 (0: no check), not "
                              f"{self.max_time_skew_s!r}")
        seen: set[str] = set()
        for user in self.users:
            if user.access_key in seen:
                raise ConfigError(f"auth.users: access_key {user.access_key!r} appears twice")
            seen.add(user.access_key)
        if self.enabled and not self.users:
            raise ConfigError("auth.enabled is true but no [[auth.users]] is configured: nobody could connect")


AUTH_OFF = AuthConfig()

_USER_KEYS = {"access_key", "secret_key", "publish", "subscribe", "groups", "admin"}
_AUTH_KEYS = {"enabled", "users", "max_time_skew_s"}


def _key(doc: Mapping[str, Any], name: str, where: str) -> str:
    value = doc.get(name)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}.{name} must be a non-empty string")
    if len(value) > MAX_KEY_CHARS or not value.isprintable() or "," in value or "/" in value \
            or any(c.isspace() for c in value):
        raise ConfigError(f"{where}.{name} must be at most {MAX_KEY_CHARS} printable characters without "
                          "spaces, ',' or '/' (the authorization header's separators)")
    return value


def _patterns(doc: Mapping[str, Any], name: str, where: str) -> tuple[str, ...]:
    value = doc.get(name, [])
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(f"{where}.{name} must be a list of non-empty strings (names or globs such as 'orders-*')")
    return tuple(value)


def parse_user(doc: Any, index: int) -> User:
    where = f"auth.users[{index}]"
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{where} must be a table ([[auth.users]])")
    unknown = set(doc) - _USER_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(_USER_KEYS))})")
    admin = doc.get("admin", False)
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}.admin must be true or false, not {toml_text(admin)}")
    return User(_key(doc, "access_key", where), _key(doc, "secret_key", where), _patterns(doc, "publish", where),
                _patterns(doc, "subscribe", where), _patterns(doc, "groups", where), admin)


def parse_auth(doc: Any) -> AuthConfig:
    """The `[auth]` table of a TOML document (its `auth` value); `AUTH_OFF` when there is none."""
    if doc is None:
        return AUTH_OFF
    if not isinstance(doc, Mapping):
        raise ConfigError("auth must be a table ([auth])")
    unknown = set(doc) - _AUTH_KEYS
    if unknown:
        raise ConfigError(f"auth: unknown keys {', '.join(sorted(unknown))} (known: {', '.join(sorted(_AUTH_KEYS))})")
    enabled = doc.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"auth.enabled must be true or false, not {toml_text(enabled)}")
    users = doc.get("users", [])
    if not isinstance(users, list):
        raise ConfigError("auth.users must be an array of tables ([[auth.users]])")
    return AuthConfig(enabled, tuple(parse_user(u, i) for i, u in enumerate(users)),
                      doc.get("max_time_skew_s", DEFAULT_MAX_TIME_SKEW_S))


def load_auth(toml_path: str | Path | None) -> AuthConfig:
    """The `[auth]` table of the server's TOML file (also accepted as `[chronoq.auth]`)."""
    if toml_path is None:
        return AUTH_OFF
    try:
        with open(toml_path, "rb") as f:
            doc = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{toml_path}: not valid TOML: {exc}") from None
    section = doc.get("auth")
    if section is None and isinstance(doc.get("chronoq"), Mapping):
        section = doc["chronoq"].get("auth")
    try:
        return parse_auth(section)
    except ConfigError as exc:  # named as the settings' errors are: the file, then what is wrong in it
        raise ConfigError(f"{toml_path}: {exc}") from None


# -- permissions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Principal:
    """The caller of one RPC and what it may do. `name` is the access key ("" for ANONYMOUS)."""

    name: str
    admin: bool = False
    _publish: tuple[re.Pattern[str], ...] = field(default=(), repr=False)
    _subscribe: tuple[re.Pattern[str], ...] = field(default=(), repr=False)
    _groups: tuple[re.Pattern[str], ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, user: User) -> Principal:
        return cls(user.access_key, user.admin, _compile(user.publish), _compile(user.subscribe),
                   _compile(user.groups))

    def may_publish(self, topic: str) -> bool:
        return self.admin or _matches(self._publish, topic)

    def may_subscribe(self, topic: str) -> bool:
        return self.admin or _matches(self._subscribe, topic)

    def may_use_group(self, group: str) -> bool:
        return self.admin or _matches(self._groups, group)

    def may_see(self, topic: str) -> bool:
        return self.may_publish(topic) or self.may_subscribe(topic)

    def require_publish(self, topics: Iterable[str]) -> None:
        for topic in topics:
            if not self.may_publish(topic):
                raise Forbidden.permission(self.name, "publish to", f"topic {topic!r}")

    def require_subscribe(self, topic: str, group: str) -> None:
        if not self.may_subscribe(topic):
            raise Forbidden.permission(self.name, "subscribe to", f"topic {topic!r}")
        if not self.may_use_group(group):
            raise Forbidden.permission(self.name, "consume as", f"group {group!r}")

    def require_see(self, topic: str) -> None:
        """Route and description queries: publishers and subscribers of the topic both need them."""
        if not self.may_see(topic):
            raise Forbidden.permission(self.name, "publish to or subscribe to", f"topic {topic!r}")

    def require_admin(self, what: str) -> None:
        if not self.admin:
            raise Forbidden.permission(self.name, "call", f"{what} (admin only)")


ANONYMOUS = Principal("", admin=True)
"""The caller when auth is off: may do everything."""


def _compile(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(fnmatch.translate(p)) for p in patterns)


def _matches(patterns: tuple[re.Pattern[str], ...], name: str) -> bool:
    return any(p.match(name) for p in patterns)


class Authenticator:
    """Turns one call's metadata into its `Principal`, or raises an `Unauthorized` error."""

    def __init__(self, config: AuthConfig) -> None:
        self.reload(config)

    def reload(self, config: AuthConfig) -> None:
        """Use `config` from the next call on (`chronoq serve` calls this on SIGHUP with the
        `[auth]` table read again). One step on the event loop, so no call sees half a table; a
        stream opened before keeps the `Principal` it was authenticated as."""
        self.config = config
        self.enabled = config.enabled
        self._users = {u.access_key: (u, Principal.of(u)) for u in config.users}
        self._max_skew_ms = config.max_time_skew_s * 1000

    def password(self, access_key: str, secret_key: str) -> Principal:
        """The user whose access key and secret key these are (the web console's HTTP Basic
        credentials: a browser can send a password, not a signature), compared in constant time."""
        if not self.enabled:
            return ANONYMOUS
        found = self._users.get(access_key)
        if found is None:
            raise Unauthorized.unknown_access_key(access_key)
        user, principal = found
        if not hmac.compare_digest(user.secret_key.encode(), secret_key.encode()):
            raise Unauthorized.wrong_secret_key(access_key)
        return principal

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None, now_ms: int) -> Principal:
        if not self.enabled:
            return ANONYMOUS
        claim = signature.read_headers(metadata or ())
        found = self._users.get(claim.access_key)
        if found is None:
            raise Unauthorized.unknown_access_key(claim.access_key)
        user, principal = found
        if not signature.verify(user.secret_key, claim):
            raise Unauthorized.bad_signature(claim.access_key)
        if self._max_skew_ms:
            skew_ms = claim.signed_at_ms - now_ms
            if abs(skew_ms) > self._max_skew_ms:
                raise Unauthorized.stale_signature(claim.date_time, skew_ms, self._max_skew_ms)
        return principal


REFUSAL_LOG_INTERVAL_S = 60.0
"""The same refusal (peer host, RPC, status message) is logged at most once in this many seconds."""
REFUSAL_LOG_MAX_KEYS = 4096


class RefusalLog:
    """Logs each refused call (40100 UNAUTHORIZED, 40300 FORBIDDEN) as one WARNING line naming the
    peer, the RPC and the reason, at most once per `interval_s` for the same peer host, RPC and
    reason. Some clients never show the server's reason: the official Python client logs a
    refused QueryRoute to its own file and raises only "failed to fetch topic:T route.", and its
    route refresh and heartbeats repeat the refusal every few seconds. So the broker's log is
    where an operator finds why a client is turned away, once a minute rather than once a call."""

    def __init__(self, logger: logging.Logger, interval_s: float = REFUSAL_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[tuple[str, str, str], float] = {}

    def note(self, rpc: str, peer: str, err: ChronoqError) -> None:
        if err.code not in (Unauthorized.code, Forbidden.code):
            return
        host = peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer  # "ipv4:127.0.0.1:5001" -> "ipv4:127.0.0.1"
        key = (host, rpc, err.message)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            return
        if len(self._last) >= REFUSAL_LOG_MAX_KEYS:  # many peers or reasons: forget, at worst a repeat line
            self._last.clear()
        self._last[key] = now
        self._log.warning("refused %s from %s: %d %s", rpc, peer, err.code, err.message)
