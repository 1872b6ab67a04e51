"""The `chronoq` data source for Spark: read a topic (batch or stream) and write messages.

Theory of operation. Built on Spark's Python Data Source API (`pyspark.sql.datasource`); reads
use chronoq's JSON admin service (`ReadMessages`, which reports commit-log positions), writes use
the SDK's `Producer`. What crosses from the driver to executors is small and picklable: the options
dict and `QueueRange(queue_id, start, end)` partitions. Every `read`/`write` runs in an executor
task and opens its own SDK client to the server named by the `server` option (host:port).

Reading. A topic is a set of queues, each an append-only log addressed by logical offset. A batch
read covers `[startingOffsets, endingOffsets)` per queue (default earliest..latest). A streaming
read's offset is a dict of primitives `{"<queue_id>": next_offset}`; Spark checkpoints it, and a
micro-batch `[start, end)` always reads exactly the same records, because the log is immutable:
restart from a checkpoint replays the last uncommitted batch and nothing else. The broker keeps
records for its retention time; a range that retention has removed reads as fewer rows.

Connection. Every client an executor opens takes the options `server` (host:port) and, when the
broker needs them, `tls`, `caCert` (the PEM text itself, so no executor needs the file),
`tlsServerName`, `accessKey` and `secretKey` (`BrokerAccess`): an executor on another machine
shares nothing with the driver but these options, so nothing is read from its environment
or disk. Reading and the timer engine's FireTimers are admin calls: with auth on, give an admin
user's keys; sending needs publish rights on the topic.

Writing. Each row becomes one message (`body` required; `topic`, `message_id`, `tag`, `keys`,
`properties`, and at most one of `deliver_at` (timestamp or epoch ms), `delay_ms`, `delay_level`
optional). Idempotence under task retry comes from message ids: a row without `message_id` gets
one derived from (write id, partition, row index); Spark retries a task over the same partition
with the same rows, so the retry sends the same ids and the broker's dedupe stores each once.
The write id is fixed per DataFrame write (a uuid chosen on the driver), or, for a stream, per
(query id, batch id), which a restart from the checkpoint keeps.

Bulk writing (option `bulk`, what `chronoq spark schedule` uses): a batch write of one topic
(`topic` option) whose rows carry `body`, `message_id`, one of `deliver_at`/`delay_ms`, `tag`,
`keys`. Spark hands each task Arrow record batches (`DataSourceArrowWriter`); the bodies go to
the SDK's `send_columns` as their Arrow offsets and data (no object per row), ids and due times as
plain lists, `sendBatchSize` rows a SendColumns request (default 4,096), two in flight. Ids,
retries, `skipStored`, the commit report and a refused row failing the task are as above.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import sys
import uuid
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from chronoq.timefmt import MAX_EPOCH_MS

if TYPE_CHECKING:
    from chronoq.client.types import StoredRecord

SOURCE_NAME = "chronoq"
READ_SCHEMA = (
    "message_id STRING, topic STRING, queue_id INT, queue_offset BIGINT, tag STRING, keys ARRAY<STRING>, "
    "properties MAP<STRING, STRING>, system_properties MAP<STRING, STRING>, body BINARY, "
    "born_ts TIMESTAMP, store_ts TIMESTAMP, deliver_at_ts TIMESTAMP, position BIGINT"
)
"""`position` is the record's commit-log position when the server reports it (else null)."""
WRITE_COLUMNS = frozenset({"topic", "body", "message_id", "tag", "keys", "properties", "deliver_at", "delay_ms",
                           "delay_level"})
DEFAULT_FETCH_SIZE = 256
"""Messages per ReadMessages call."""
DEFAULT_RECORDS_PER_PARTITION = 50_000
DEFAULT_SEND_BATCH = 256
"""Messages per SendBatch call from a writer task."""
DEFAULT_BULK_ROWS = 4096
"""Rows per SendColumns request from a bulk writer task (option `bulk`)."""
UTC = dt.UTC


class ChronoqSourceError(ValueError):
    """A `chronoq` data source option or row is invalid; the message names the option or column."""


# -- options ---------------------------------------------------------------------------------


def _require(options: Mapping[str, str], name: str) -> str:
    value = options.get(name)
    if not value:
        raise ChronoqSourceError(f"the chronoq data source needs option {name!r}")
    return value


def _int_option(options: Mapping[str, str], name: str, default: int) -> int:
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ChronoqSourceError(f"option {name!r} must be an integer, not {raw!r}") from None
    if value < 1:
        raise ChronoqSourceError(f"option {name!r} must be at least 1, not {value}")
    return value


def _offsets_option(options: Mapping[str, str], name: str, default: str) -> str | dict[int, int]:
    raw = options.get(name, default)
    if raw in ("earliest", "latest"):
        return raw
    try:
        parsed = json.loads(raw)
        return {int(k): int(v) for k, v in parsed.items()}
    except (ValueError, AttributeError, TypeError):
        raise ChronoqSourceError(
            f"option {name!r} must be 'earliest', 'latest' or JSON like {{\"0\": 42}}, not {raw!r}") from None


# -- the server seam: the blocking SDK, one client per task (reads report each record's
# -- commit-log `position`; writes get the Producer's batching, retries, per-message outcomes)


@dataclass(frozen=True)
class BrokerAccess:
    """Where and how an executor's SDK client connects: host:port, TLS, credentials.

    Built from a data source's options on the driver and pickled to the tasks; `options()` is the
    reverse, for a job that sets up a read or write. The secret key travels in the job's options,
    to the executors, as the SDK takes it: an argument, never a file an executor would need.
    """

    server: str
    tls: bool = False
    ca_cert: str | None = None
    tls_server_name: str | None = None
    access_key: str | None = None
    secret_key: str | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> BrokerAccess:
        tls_raw = (options.get("tls") or "false").strip().lower()
        if tls_raw not in ("true", "false", "1", "0"):
            raise ChronoqSourceError(f"option 'tls' must be true or false, not {options.get('tls')!r}")
        ca_cert = options.get("caCert") or None
        if ca_cert is not None and "-----BEGIN CERTIFICATE-----" not in ca_cert:
            raise ChronoqSourceError("option 'caCert' must hold the PEM text of the CA certificate (it is sent to "
                                     "the executors), not a path")
        access_key = options.get("accessKey") or None
        secret_key = options.get("secretKey") or None
        if access_key and not secret_key:
            raise ChronoqSourceError("option 'accessKey' needs option 'secretKey'")
        return cls(server=_require(options, "server"), tls=tls_raw in ("true", "1"), ca_cert=ca_cert,
                   tls_server_name=options.get("tlsServerName") or None, access_key=access_key,
                   secret_key=secret_key)

    def options(self) -> dict[str, str]:
        out = {"server": self.server}
        if self.tls:
            out["tls"] = "true"
        for name, value in (("caCert", self.ca_cert), ("tlsServerName", self.tls_server_name),
                            ("accessKey", self.access_key), ("secretKey", self.secret_key)):
            if value:
                out[name] = value
        return out

    def client_kwargs(self) -> dict[str, Any]:
        return {"tls": self.tls, "root_certificates": self.ca_cert.encode() if self.ca_cert else None,
                "tls_server_name": self.tls_server_name, "access_key": self.access_key,
                "secret_key": self.secret_key}


def _access(where: str | BrokerAccess) -> BrokerAccess:
    return where if isinstance(where, BrokerAccess) else BrokerAccess(where)


def _producer(where: str | BrokerAccess) -> Any:
    from chronoq.client import Producer

    access = _access(where)
    return Producer(access.server, batch_via="admin", **access.client_kwargs())


def admin_client(where: str | BrokerAccess) -> Any:
    """A blocking `Admin` to the broker `where` names (host:port, or a `BrokerAccess`)."""
    from chronoq.client import Admin

    access = _access(where)
    return Admin(access.server, **access.client_kwargs())


def queue_bounds(server: str | BrokerAccess, topic: str, *,
                 missing_ok: bool = False) -> dict[int, tuple[int, int]]:
    """{queue_id: (min_offset, next_offset)} of `topic`, from the server. With `missing_ok`, a topic
    that does not exist yet has no queues (a stream waits for it; the broker creates its timer
    topic with the first timer message)."""
    from chronoq.errors import TopicNotFound

    with admin_client(server) as admin:
        try:
            description = admin.describe_topic(topic)
        except TopicNotFound:
            if missing_ok:
                return {}
            raise
    return {q.queue_id: (q.min_offset, q.max_offset) for q in description.queues}


# -- reading ---------------------------------------------------------------------------------


class QueueRange(InputPartition):
    """Offsets [start, end) of one queue: what one read task covers (small and picklable)."""

    def __init__(self, queue_id: int, start: int, end: int) -> None:
        super().__init__((queue_id, start, end))
        self.queue_id = queue_id
        self.start = start
        self.end = end

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QueueRange) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"QueueRange(queue_id={self.queue_id}, start={self.start}, end={self.end})"


def split_ranges(starts: Mapping[int, int], ends: Mapping[int, int], per_partition: int) -> list[QueueRange]:
    """Cut each queue's [start, end) into partitions of at most `per_partition` offsets."""
    out = []
    for queue_id in sorted(ends):
        start, end = starts.get(queue_id, 0), ends[queue_id]
        while start < end:
            stop = min(end, start + per_partition)
            out.append(QueueRange(queue_id, start, stop))
            start = stop
    return out


def _ts(ms: int | None) -> dt.datetime | None:
    """A time column; None past the year 9999 (a born time the producer set in the wrong unit,
    stored before the broker refused such times), which no timestamp holds: one such record
    failed every read of its topic, for good."""
    return dt.datetime.fromtimestamp(ms / 1000, tz=UTC) if ms is not None and 0 <= ms <= MAX_EPOCH_MS else None


def _row(m: StoredRecord) -> tuple:
    return (m.message_id, m.topic, m.queue_id, m.queue_offset, m.tag, list(m.keys), dict(m.properties),
            dict(m.system_properties), m.body, _ts(m.born_ms), _ts(m.store_ms), _ts(m.deliver_at_ms), m.position)


def read_range(server: str | BrokerAccess, topic: str, part: QueueRange, fetch_size: int) -> Iterator[tuple]:
    """The rows of one partition, in offset order (runs on an executor)."""
    offset = part.start
    with admin_client(server) as admin:
        while offset < part.end:
            result = admin.read(topic, part.queue_id, offset, min(fetch_size, part.end - offset))
            for m in result.messages:
                if part.start <= m.queue_offset < part.end:
                    yield _row(m)
            next_offset = result.next_offset
            if next_offset <= offset:
                return  # nothing more stored (removed by retention, or not yet written)
            offset = next_offset


class ChronoqBatchReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.server = BrokerAccess.from_options(options)
        self.topic = _require(options, "topic")
        self.fetch_size = _int_option(options, "fetchSize", DEFAULT_FETCH_SIZE)
        self.per_partition = _int_option(options, "recordsPerPartition", DEFAULT_RECORDS_PER_PARTITION)
        self.starting = _offsets_option(options, "startingOffsets", "earliest")
        self.ending = _offsets_option(options, "endingOffsets", "latest")

    def partitions(self) -> Sequence[InputPartition]:
        bounds = queue_bounds(self.server, self.topic)
        starts = _resolve(self.starting, bounds)
        ends = _resolve(self.ending, bounds)
        return split_ranges(starts, ends, self.per_partition)

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        assert isinstance(partition, QueueRange)
        yield from read_range(self.server, self.topic, partition, self.fetch_size)


def _resolve(spec: str | dict[int, int], bounds: Mapping[int, tuple[int, int]]) -> dict[int, int]:
    if spec == "earliest":
        return {q: lo for q, (lo, _) in bounds.items()}
    if spec == "latest":
        return {q: hi for q, (_, hi) in bounds.items()}
    assert isinstance(spec, dict)
    return {q: min(max(spec.get(q, lo), lo), hi) for q, (lo, hi) in bounds.items()}


def _encode_offset(offsets: Mapping[int, int]) -> dict[str, int]:
    return {str(q): int(o) for q, o in sorted(offsets.items())}


def _decode_offset(offset: Mapping[str, Any]) -> dict[int, int]:
    return {int(q): int(o) for q, o in offset.items()}


def limit_offsets(start: Mapping[int, int], latest: Mapping[int, int], max_rows: int | None) -> dict[int, int]:
    """The end offsets of the next batch: everything up to `latest`, or at most `max_rows` records,
    shared out evenly over the queues that have data (leftover share goes to the busier ones)."""
    end = {q: max(start.get(q, 0), hi) for q, hi in latest.items()}
    if max_rows is None:
        return end
    backlog = {q: end[q] - start.get(q, 0) for q in end if end[q] > start.get(q, 0)}
    budget = max_rows
    take = dict.fromkeys(backlog, 0)
    while budget > 0 and backlog:
        share = max(1, budget // len(backlog))
        for q in list(backlog):
            n = min(share, backlog[q], budget)
            take[q] += n
            backlog[q] -= n
            budget -= n
            if backlog[q] == 0:
                del backlog[q]
            if budget == 0:
                break
    return {q: start.get(q, 0) + take.get(q, 0) for q in end}


class ChronoqStreamReader(DataSourceStreamReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.server = BrokerAccess.from_options(options)
        self.topic = _require(options, "topic")
        self.fetch_size = _int_option(options, "fetchSize", DEFAULT_FETCH_SIZE)
        self.per_partition = _int_option(options, "recordsPerPartition", DEFAULT_RECORDS_PER_PARTITION)
        self.starting = _offsets_option(options, "startingOffsets", "latest")
        raw_max = options.get("maxRecordsPerBatch")
        self.max_rows = _int_option(options, "maxRecordsPerBatch", 1) if raw_max is not None else None

    def initialOffset(self) -> dict:
        return _encode_offset(_resolve(self.starting, queue_bounds(self.server, self.topic, missing_ok=True)))

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_rows) if self.max_rows is not None else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = _decode_offset(start)
        latest = {q: hi for q, (_, hi) in queue_bounds(self.server, self.topic, missing_ok=True).items()}
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return _encode_offset(limit_offsets(begin, latest, max_rows))

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        return split_ranges(_decode_offset(start), _decode_offset(end), self.per_partition)

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        assert isinstance(partition, QueueRange)
        yield from read_range(self.server, self.topic, partition, self.fetch_size)

    def commit(self, end: dict) -> None:
        # The broker keeps records for its retention time whatever readers do; nothing to release.
        return None


# -- writing ---------------------------------------------------------------------------------


@dataclass
class ChronoqCommitMessage(WriterCommitMessage):
    sent: int
    duplicates: int
    timers: int
    skipped: int = 0
    """Rows not sent because the broker already held their id (option `skipStored`)."""


STORED_LOOKUPS_IN_FLIGHT = 32
"""QueryMessage calls a task keeps open at once for option `skipStored`."""


def stored_ids(where: str | BrokerAccess, keys: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
    """The (topic, message id) pairs of `keys` the broker knows as timer messages (pending,
    delivered or cancelled: its timer index), one QueryMessage each, `STORED_LOOKUPS_IN_FLIGHT` at once."""
    import asyncio

    from chronoq.client.aio import AsyncAdmin

    access = _access(where)

    async def lookup() -> set[tuple[str, str]]:
        found: set[tuple[str, str]] = set()
        gate = asyncio.Semaphore(STORED_LOOKUPS_IN_FLIGHT)
        async with AsyncAdmin(access.server, **access.client_kwargs()) as admin:
            async def one(key: tuple[str, str]) -> None:
                async with gate:
                    if await admin.query(key[1], key[0]):
                        found.add(key)

            await asyncio.gather(*(one(k) for k in keys))
        return found

    return asyncio.run(lookup())


def derived_message_id(write_id: str, partition_id: int, index: int) -> str:
    """A stable id for row `index` of `partition_id` in one write (same on a task retry)."""
    digest = hashlib.blake2b(f"{write_id}:{partition_id}:{index}".encode(), digest_size=16).hexdigest().upper()
    return f"SP{digest}"


def _epoch_ms(value: Any, column: str) -> int:
    if isinstance(value, dt.datetime):
        return int(value.timestamp() * 1000)  # naive values are local time, as PySpark made them
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ChronoqSourceError(f"column {column!r} must be a timestamp or epoch milliseconds, not {value!r}")


def row_to_message(row: Mapping[str, Any], default_topic: str | None, fallback_id: str) -> Any:
    """One DataFrame row as an `OutgoingMessage` (raises ChronoqSourceError naming the column)."""
    from chronoq.model import OutgoingMessage

    topic = row.get("topic") or default_topic
    if not topic:
        raise ChronoqSourceError("a row has no 'topic' column value and the write has no 'topic' option")
    body = row.get("body")
    if body is None:
        raise ChronoqSourceError("a row has a null 'body'")
    body = body.encode("utf-8") if isinstance(body, str) else bytes(body)
    keys = row.get("keys") or ()
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    timer = {name: row.get(name) for name in ("deliver_at", "delay_ms", "delay_level") if row.get(name) is not None}
    if len(timer) > 1:
        raise ChronoqSourceError(f"a row sets more than one of deliver_at, delay_ms, delay_level: {sorted(timer)}")
    return OutgoingMessage(
        topic=topic, body=body, message_id=row.get("message_id") or fallback_id, tag=row.get("tag") or None,
        keys=keys, properties=dict(row.get("properties") or {}),
        deliver_at_ms=_epoch_ms(timer["deliver_at"], "deliver_at") if "deliver_at" in timer else None,
        delay_ms=int(timer["delay_ms"]) if "delay_ms" in timer else None,
        delay_level=int(timer["delay_level"]) if "delay_level" in timer else None,
    )


def send_rows(server: str | BrokerAccess, default_topic: str | None, rows: Iterator[Any], write_id: str,
              batch_size: int, *, skip_stored: bool = False) -> ChronoqCommitMessage:
    """Send rows in SendBatch calls; any refused message fails the task, naming why. With
    `skip_stored`, ids the broker already holds as timer messages are not sent again (a rerun
    after the broker restarted, when its in-memory dedupe window no longer has them)."""
    from pyspark import TaskContext

    from chronoq.client import BatchSendError
    from chronoq.errors import ChronoqError

    ctx = TaskContext.get()
    partition_id = ctx.partitionId() if ctx is not None else 0
    sent = duplicates = timers = skipped = 0
    batch: list[Any] = []

    def flush() -> None:
        nonlocal sent, duplicates, timers, skipped
        if skip_stored and batch:
            try:
                known = stored_ids(server, [(m.topic, m.message_id) for m in batch])
            except ChronoqError as e:
                raise ChronoqSourceError(f"asking {_access(server).server} which ids it holds failed: "
                                         f"{type(e).__name__}: {e.message}") from None
            kept = [m for m in batch if (m.topic, m.message_id) not in known]
            skipped += len(batch) - len(kept)
            batch[:] = kept
        if not batch:
            return
        try:
            receipts = producer.send_batch(batch)
        except BatchSendError as e:
            index, first = e.outcome.errors[0]
            raise ChronoqSourceError(f"{len(e.outcome.errors)} of {len(batch)} messages refused; the first, id "
                                     f"{batch[index].message_id}: {first}") from None
        except ChronoqError as e:
            # One line the driver can find in the task's failure and show whole (the SDK has retried).
            raise ChronoqSourceError(f"sending to {_access(server).server} failed after {sent} messages of this "
                                     f"task were accepted: {type(e).__name__}: {e.message}") from None
        sent += len(receipts)
        duplicates += sum(1 for r in receipts if r.duplicate)
        timers += sum(1 for m in batch if m.deliver_at_ms is not None or m.delay_ms is not None
                      or m.delay_level is not None)
        batch.clear()

    with _producer(server) as producer:
        for index, row in enumerate(rows):
            fields = row.asDict() if hasattr(row, "asDict") else dict(row)
            batch.append(row_to_message(fields, default_topic, derived_message_id(write_id, partition_id, index)))
            if len(batch) >= batch_size:
                flush()
        flush()
    return ChronoqCommitMessage(sent, duplicates, timers, skipped)


def _check_write_schema(schema: Any) -> None:
    names = set(schema.fieldNames())
    if "body" not in names:
        raise ChronoqSourceError(f"writing to chronoq needs a 'body' column; the DataFrame has {sorted(names)}")
    unknown = names - WRITE_COLUMNS
    if unknown:
        raise ChronoqSourceError(f"columns {sorted(unknown)} are not message fields; chronoq takes "
                                 f"{sorted(WRITE_COLUMNS)}")


class ChronoqBatchWriter(DataSourceWriter):
    def __init__(self, options: Mapping[str, str], schema: Any) -> None:
        _check_write_schema(schema)
        self.server = BrokerAccess.from_options(options)
        self.topic = options.get("topic")
        self.batch_size = _int_option(options, "sendBatchSize", DEFAULT_SEND_BATCH)
        # Chosen once on the driver and pickled to every task, so a retried task derives the same ids.
        self.write_id = options.get("writeId") or uuid.uuid4().hex
        self.commit_report = options.get("commitReport") or None
        self.skip_stored = (options.get("skipStored") or "false").strip().lower() in ("true", "1")

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        return send_rows(self.server, self.topic, iterator, self.write_id, self.batch_size,
                         skip_stored=self.skip_stored)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        write_commit_report(self.commit_report, messages, finished=True)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        # Sent messages cannot be unsent; rerunning the write with the same writeId resends the same ids.
        write_commit_report(self.commit_report, messages, finished=False)


BULK_COLUMNS = frozenset({"body", "message_id", "deliver_at", "delay_ms", "tag", "keys"})
"""What a bulk write (option `bulk`) carries: one topic (the `topic` option), rows of these columns."""


def _check_bulk_schema(schema: Any, topic: str | None) -> None:
    names = set(schema.fieldNames())
    if not topic:
        raise ChronoqSourceError("a bulk write (option 'bulk') needs the 'topic' option: one topic a write")
    unknown = names - BULK_COLUMNS
    if unknown:
        raise ChronoqSourceError(f"columns {sorted(unknown)} cannot go through a bulk write; it takes "
                                 f"{sorted(BULK_COLUMNS)}")
    if {"deliver_at", "delay_ms"} <= names:
        raise ChronoqSourceError("a bulk write takes one of the columns 'deliver_at' and 'delay_ms', not both")


def _arrow_bodies(column: Any) -> Any:
    """A body column (binary or string) as `Packed`: its own offsets and data buffers, no row objects."""
    import pyarrow as pa

    from chronoq.protocol.bulk import Packed

    if column.null_count:
        raise ChronoqSourceError("a row has a null 'body'")
    if not pa.types.is_binary(column.type):
        column = column.cast(pa.binary())
    n, first = len(column), column.offset
    offsets = array("i")
    offsets.frombytes(column.buffers()[1].to_pybytes()[4 * first:4 * (first + n + 1)])
    if sys.byteorder != "little":
        offsets.byteswap()
    start, end = (offsets[0], offsets[-1]) if n else (0, 0)
    if start:
        offsets = array("i", [o - start for o in offsets])
    data = column.buffers()[2]
    return Packed(offsets, data.to_pybytes()[start:end] if data is not None else b"")


def _arrow_ms(column: Any, name: str) -> array:
    """A due column (epoch ms, or a timestamp) as int64 ms; a null is the row's error, as `_epoch_ms` says."""
    import pyarrow as pa

    if column.null_count:
        raise ChronoqSourceError(f"column {name!r} has a null: give every row of a bulk write its {name}")
    if pa.types.is_timestamp(column.type):
        # Whole ms since the epoch, the sub-ms part dropped (toward zero, as `_epoch_ms`'s int()).
        per_ms = {"s": None, "ms": 1, "us": 1000, "ns": 1_000_000}[column.type.unit]
        values = column.cast(pa.int64()).to_pylist()
        if per_ms is None:
            return array("q", [v * 1000 for v in values])
        return array("q", [v // per_ms if v >= 0 else -(-v // per_ms) for v in values])
    if not pa.types.is_integer(column.type):
        raise ChronoqSourceError(f"column {name!r} must be a timestamp or epoch milliseconds, not {column.type}")
    return array("q", column.cast(pa.int64()).to_pylist())


def send_arrow_batches(server: str | BrokerAccess, topic: str, batches: Iterator[Any], write_id: str,
                       rows_per_request: int, *, skip_stored: bool = False) -> ChronoqCommitMessage:
    """Send Arrow record batches through the bulk send (`Producer.send_columns`, admin
    SendColumns): bodies straight from their Arrow buffers, thousands of rows a request, two
    requests in flight. Any refused row fails the task, naming why (as `send_rows`); with
    `skip_stored`, ids the broker already holds as timer messages are not sent again."""
    import pyarrow as pa
    from pyspark import TaskContext

    from chronoq.errors import ChronoqError

    ctx = TaskContext.get()
    partition_id = ctx.partitionId() if ctx is not None else 0
    sent = duplicates = timers = skipped = 0
    row_index = 0
    with _producer(server) as producer:
        producer.max_bulk_rows = rows_per_request
        for batch in batches:
            n = batch.num_rows
            if not n:
                continue
            names = batch.schema.names
            ids = batch.column("message_id").to_pylist() if "message_id" in names else [None] * n
            ids = [mid or derived_message_id(write_id, partition_id, row_index + i) for i, mid in enumerate(ids)]
            row_index += n
            if skip_stored:
                try:
                    known = stored_ids(server, [(topic, mid) for mid in ids])
                except ChronoqError as e:
                    raise ChronoqSourceError(f"asking {_access(server).server} which ids it holds failed: "
                                             f"{type(e).__name__}: {e.message}") from None
                if known:
                    keep = [(topic, mid) not in known for mid in ids]
                    skipped += n - sum(keep)
                    batch = batch.filter(pa.array(keep))
                    ids = [mid for mid, k in zip(ids, keep, strict=True) if k]
                    n = batch.num_rows
                    if not n:
                        continue
            due: dict[str, Any] = {}
            for name, arg in (("deliver_at", "deliver_at_ms"), ("delay_ms", "delay_ms")):
                if name in names:
                    due[arg] = _arrow_ms(batch.column(name), name)
            tags = batch.column("tag").to_pylist() if "tag" in names else None
            keys = None
            if "keys" in names:
                keys = [() if k is None else (k,) if isinstance(k, str) else tuple(k)
                        for k in batch.column("keys").to_pylist()]
            try:
                outcome = producer.send_columns(topic, _arrow_bodies(batch.column("body")), message_ids=ids,
                                                tags=tags, keys=keys, **due)
            except ChronoqError as e:
                # One line the driver can find in the task's failure and show whole (the SDK has retried).
                raise ChronoqSourceError(f"sending to {_access(server).server} failed after {sent} messages of this "
                                         f"task were accepted: {type(e).__name__}: {e.message}") from None
            if outcome.errors:
                index = min(outcome.errors)
                raise ChronoqSourceError(f"{len(outcome.errors)} of {n} messages refused; the first, id "
                                         f"{ids[index]}: {outcome.errors[index]}")
            sent += n
            duplicates += outcome.duplicates
            timers += n if due else 0
    return ChronoqCommitMessage(sent, duplicates, timers, skipped)


class ChronoqArrowWriter(DataSourceArrowWriter):
    """The batch write with option `bulk`: Arrow batches through the bulk send (`send_arrow_batches`)."""

    def __init__(self, options: Mapping[str, str], schema: Any) -> None:
        _check_write_schema(schema)
        self.server = BrokerAccess.from_options(options)
        self.topic = options.get("topic") or ""
        _check_bulk_schema(schema, self.topic)
        self.rows_per_request = _int_option(options, "sendBatchSize", DEFAULT_BULK_ROWS)
        self.write_id = options.get("writeId") or uuid.uuid4().hex
        self.commit_report = options.get("commitReport") or None
        self.skip_stored = (options.get("skipStored") or "false").strip().lower() in ("true", "1")

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        return send_arrow_batches(self.server, self.topic, iterator, self.write_id, self.rows_per_request,
                                  skip_stored=self.skip_stored)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        write_commit_report(self.commit_report, messages, finished=True)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        write_commit_report(self.commit_report, messages, finished=False)


def write_commit_report(path: str | None, messages: Sequence[WriterCommitMessage | None], *, finished: bool) -> None:
    """With option `commitReport`, the totals of the tasks' commit messages as JSON at `path`.

    Spark runs `commit`/`abort` on the driver's machine, in a Python process of its own, so a
    return value cannot reach the program that started the write: this file does (a local path
    the driver reads; `chronoq spark schedule` reports its `duplicates`, ids the broker already
    held). On abort, only the tasks that finished are counted: the failed one may have sent some."""
    if not path:
        return
    done = [m for m in messages if isinstance(m, ChronoqCommitMessage)]
    report = {"finished": finished, "tasks_done": len(done), "tasks": len(messages),
              "sent": sum(m.sent for m in done), "duplicates": sum(m.duplicates for m in done),
              "timers": sum(m.timers for m in done), "skipped": sum(m.skipped for m in done)}
    with open(path, "w", encoding="utf-8") as out:
        json.dump(report, out)


class ChronoqStreamWriter(DataSourceStreamWriter):
    def __init__(self, options: Mapping[str, str], schema: Any) -> None:
        _check_write_schema(schema)
        self.server = BrokerAccess.from_options(options)
        self.topic = options.get("topic")
        self.batch_size = _int_option(options, "sendBatchSize", DEFAULT_SEND_BATCH)

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        query_id = ctx.getLocalProperty("sql.streaming.queryId") if ctx else None
        batch_id = ctx.getLocalProperty("streaming.sql.batchId") if ctx else None
        if query_id is None or batch_id is None:
            raise ChronoqSourceError("the streaming writer found no query id / batch id in its task context")
        return send_rows(self.server, self.topic, iterator, f"{query_id}:{batch_id}", self.batch_size)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        return None

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        # Sent messages cannot be unsent; a retried batch resends the same ids and the broker dedupes.
        return None


class ChronoqDataSource(DataSource):
    """`spark.read.format("chronoq").option("server", "host:port").option("topic", T).load()`."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return READ_SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return ChronoqBatchReader(self.options)

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return ChronoqStreamReader(self.options)

    def writer(self, schema: Any, overwrite: bool) -> DataSourceWriter:
        if (self.options.get("bulk") or "false").strip().lower() in ("true", "1"):
            return ChronoqArrowWriter(self.options, schema)
        return ChronoqBatchWriter(self.options, schema)

    def streamWriter(self, schema: Any, overwrite: bool) -> DataSourceStreamWriter:
        return ChronoqStreamWriter(self.options, schema)


def register(spark: Any) -> None:
    """Make `format("chronoq")` available in this session."""
    spark.dataSource.register(ChronoqDataSource)
