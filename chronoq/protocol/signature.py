"""RocketMQ 5 ACL 2.0 request signatures: read, check and make them. No I/O, no clock.

Theory of operation: every RPC of an official RocketMQ 5 client carries two headers,

    x-mq-date-time: 20261123T093000Z
    authorization:  MQv2-HMAC-SHA1 Credential=<accessKey>, SignedHeaders=x-mq-date-time, Signature=<hex>

where the signature is HMAC-SHA1 keyed by the secret key over the exact `x-mq-date-time` string.
This module turns the headers into a `SignedRequest` (`read_headers`), checks a signature against
a secret (`verify`, constant time), and makes the headers for chronoq's own SDK (`sign_headers`).
It is the whole wire rule, in one place: the server's auth room (`chronoq.server.auth`) decides
who the key belongs to and what it may do, and passes the time in.

Parsing follows RocketMQ's server (`DefaultAuthenticationContextBuilder`) so that every official
client's header is read as RocketMQ reads it: the scheme is what precedes the first space; the rest
splits on `,`, each part on its first `=`, names trimmed; the user is `Credential` before any `/`;
hex is decoded case-insensitively (Python and Go send lowercase, Java and Node uppercase). Where
RocketMQ is lenient about garbage, this reader refuses with `Unauthorized` (cause "malformed") naming the
fault: a header longer than `MAX_HEADER_CHARS`, no `Signature`, a signature that is not hex of
SHA-1's length, a date that is not `%Y%m%dT%H%M%SZ`. `SignedHeaders` must name `x-mq-date-time`
(the only header any client signs). Python sends the header even with empty credentials
(`Credential=`): that reads as no credentials (`Unauthorized.no_credentials`), not as a user named "".
Java's `x-mq-session-token` (temporary STS credentials) is read and ignored: chronoq has no
session tokens, and the signature alone authenticates.

The date is parsed as written, as UTC. Python and Go clients write their *local* time with a
literal `Z`, so a freshness window must allow a time zone's offset; the window is policy and
lives with the caller (`chronoq.server.auth`).

Decoders raise only chronoq's own errors (fuzzed in tests/server/test_hostile_input.py).
"""

from __future__ import annotations

import binascii
import calendar
import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from chronoq.errors import Unauthorized

SCHEME = "MQv2-HMAC-SHA1"
AUTHORIZATION_HEADER = "authorization"
DATE_TIME_HEADER = "x-mq-date-time"
SESSION_TOKEN_HEADER = "x-mq-session-token"
DATE_TIME_FORMAT = "%Y%m%dT%H%M%SZ"
MAX_HEADER_CHARS = 1024
"""Longest `authorization` header read; a longer one is refused before it is split."""
SIGNATURE_BYTES = hashlib.sha1().digest_size

_DATE_TIME = re.compile(r"\d{8}T\d{6}Z")


@dataclass(frozen=True, slots=True)
class SignedRequest:
    """What a request claims: who (`access_key`), when (`date_time`, as sent, and `signed_at_ms`
    read as UTC), and the proof (`signature`, decoded)."""

    access_key: str
    date_time: str
    signed_at_ms: int
    signature: bytes


def sign(secret_key: str, date_time: str) -> str:
    """The signature, lowercase hex (as the Python client writes it)."""
    return hmac.new(secret_key.encode(), date_time.encode(), hashlib.sha1).hexdigest()


def date_time_of(now_ms: int) -> str:
    """`x-mq-date-time` for an instant, in UTC (as the Node client writes it)."""
    return datetime.fromtimestamp(now_ms // 1000, UTC).strftime(DATE_TIME_FORMAT)


def sign_headers(access_key: str, secret_key: str, now_ms: int) -> tuple[tuple[str, str], ...]:
    """The two headers an official client adds to every call, for chronoq's SDK."""
    date_time = date_time_of(now_ms)
    authorization = (f"{SCHEME} Credential={access_key}, SignedHeaders={DATE_TIME_HEADER}, "
                     f"Signature={sign(secret_key, date_time)}")
    return (DATE_TIME_HEADER, date_time), (AUTHORIZATION_HEADER, authorization)


def parse_date_time(text: str) -> int:
    """`20261123T093000Z` -> milliseconds since the epoch, read as UTC."""
    if not _DATE_TIME.fullmatch(text):
        raise Unauthorized.malformed(DATE_TIME_HEADER, f"{text[:40]!r} is not {DATE_TIME_FORMAT}")
    try:
        parsed = datetime.strptime(text, DATE_TIME_FORMAT)
    except ValueError:
        raise Unauthorized.malformed(DATE_TIME_HEADER, f"{text!r} is not a real date and time") from None
    return calendar.timegm(parsed.timetuple()) * 1000


def parse_authorization(header: str) -> tuple[str, str, bytes]:
    """(access key, signed headers, signature bytes) from an `authorization` value.
    `Unauthorized.no_credentials` for an empty access key; `Unauthorized.malformed` for anything else amiss."""
    if len(header) > MAX_HEADER_CHARS:
        raise Unauthorized.malformed(AUTHORIZATION_HEADER, f"{len(header)} characters, at most {MAX_HEADER_CHARS}")
    scheme, space, rest = header.strip().partition(" ")
    if scheme != SCHEME or not space:
        raise Unauthorized.malformed(AUTHORIZATION_HEADER, f"scheme {scheme[:40]!r}, expected {SCHEME!r}")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        name, eq, value = part.partition("=")
        if not eq:
            raise Unauthorized.malformed(AUTHORIZATION_HEADER, f"{part.strip()[:40]!r} is not NAME=VALUE")
        fields[name.strip()] = value.strip()
    credential = fields.get("Credential")
    if credential is None:
        raise Unauthorized.malformed(AUTHORIZATION_HEADER, "no Credential")
    access_key = credential.split("/", 1)[0]
    if not access_key:
        raise Unauthorized.no_credentials(AUTHORIZATION_HEADER)
    signed_headers = fields.get("SignedHeaders", "")
    if DATE_TIME_HEADER not in (h.strip().lower() for h in signed_headers.split(";")):
        raise Unauthorized.malformed(AUTHORIZATION_HEADER, f"SignedHeaders {signed_headers[:60]!r} does not name "
                                     f"{DATE_TIME_HEADER}")
    hex_signature = fields.get("Signature")
    if not hex_signature:
        raise Unauthorized.malformed(AUTHORIZATION_HEADER, "no Signature")
    if len(hex_signature) != 2 * SIGNATURE_BYTES:
        raise Unauthorized.malformed(AUTHORIZATION_HEADER, f"Signature has {len(hex_signature)} hex digits, "
                                     f"HMAC-SHA1 has {2 * SIGNATURE_BYTES}")
    try:
        signature = binascii.unhexlify(hex_signature)
    except (binascii.Error, ValueError):
        raise Unauthorized.malformed(AUTHORIZATION_HEADER, "Signature is not hex") from None
    return access_key, signed_headers, signature


def read_headers(metadata: Iterable[tuple[str, str | bytes]]) -> SignedRequest:
    """The signed claim of one call's metadata; `Unauthorized.no_credentials` when it has none."""
    authorization = date_time = None
    for key, value in metadata:
        if key == AUTHORIZATION_HEADER:
            authorization = value
        elif key == DATE_TIME_HEADER:
            date_time = value
    if authorization is None:
        raise Unauthorized.no_credentials(AUTHORIZATION_HEADER)
    if not isinstance(authorization, str) or not isinstance(date_time, str | None):
        raise Unauthorized.malformed(AUTHORIZATION_HEADER, "binary header value")
    access_key, _, signature = parse_authorization(authorization)
    if date_time is None:
        raise Unauthorized.malformed(DATE_TIME_HEADER, "missing (it is the signed header)")
    return SignedRequest(access_key, date_time, parse_date_time(date_time), signature)


def verify(secret_key: str, request: SignedRequest) -> bool:
    """Whether `request.signature` is the secret's signature of its date, compared in constant time."""
    expected = hmac.new(secret_key.encode(), request.date_time.encode(), hashlib.sha1).digest()
    return hmac.compare_digest(expected, request.signature)
