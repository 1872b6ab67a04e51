"""chronoq's HTTP side: `/metrics` for Prometheus, `/healthz`, and the web console.

Theory of operation: `chronoq serve --http-port PORT` (config `http_port`; 0 = off) starts one
aiohttp application on the broker's own event loop, beside the gRPC server, on the same host.
Sharing the loop is what makes it cheap and consistent: a handler reads broker state between two
broker steps, with no lock and no copy, and costs the hot path nothing until someone asks
(`http/metrics.py` says how little the counters cost). Each handler does bounded work (the
search and chart limits in `config.py`), so a scrape or a console click never stalls the loop.

Routes:
- `GET /metrics`: the Prometheus text format, by prometheus_client from `BrokerCollector`. It
  names every topic and consumer group, so with auth on it asks for an admin user's HTTP Basic
  credentials (`Access.check(request, "admin")`; Prometheus: `basic_auth` in the scrape config).
- `GET /healthz`: 200 `{"ready": true, ...}` while the broker accepts sends; otherwise 503 with
  the reason (the broker failed, shutting down, the disk below `disk_min_free_bytes`, or starting:
  `serve` starts this side before the gRPC port opens, and says when that port serves).
- `GET /`: the console page (`static/`); its script calls the JSON endpoints under `/api/` and
  shows the SVG charts under `/chart/`. They call the admin service's methods in process (the same
  API as the gRPC admin service and the CLI), each through `HttpServer.call`: the access check
  (`Access.check`, `http/console.py`: "read", or "admin" for cancel), then the method. The
  delivery-error chart calls no admin method and spans every topic: it asks for "admin" itself.
  `/healthz` alone answers without credentials (it says only whether the broker is ready).
- `GET /api/topics`: who the caller is (`user`, `admin`) and the topics it may see (ListTopics),
  what the page's topic drop-down lists and whether it shows the admin views.

A caller without the admin role (auth on) gets every read view cut to the topics it may publish
or subscribe to: the admin methods that span every topic (Stats, PendingByDue, SearchTimers and
QueryMessage without a topic) are admin only, so for such a caller the overview, the pending
chart, a search without a topic and a look-up read the broker as those methods do and keep what
`Principal.may_see` allows (`http/scope.py`). An admin's replies are the admin methods' own.

Errors are converted at one point, `_errors`: a `ChronoqError` (bad input, unknown topic or
message, a refused cancel) becomes a JSON reply `{"error", "message", "details"}` (details: the
error's values) with a 4xx status, and anything else a 500 with "internal error; see the server
log" and a log line: never a traceback in a reply.

A gRPC client pointed at this port by mistake (its HTTP/2 preface, `PRI * HTTP/2.0`, is not
HTTP/1.1) is logged as one WARNING line naming the gRPC port (`ConnectionLog`), not aiohttp's
parse-error traceback; the client's gRPC sees a 400 from an HTTP/1.x server, which chronoq's SDK
and CLI report as "answers HTTP/1.1, not gRPC".

The server owns its one background task, the delivery-error sampler (`run`); `serve` runs it in
its task group and stops the HTTP side before the broker closes.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from chronoq.config import Config, ConfigError
from chronoq.errors import ChronoqError, Unauthorized
from chronoq.http.console import (
    HORIZONS,
    Access,
    ConsoleInputError,
    ErrorHistory,
    Forbidden,
    Role,
    check_range,
    error_chart_svg,
    format_utc,
    horizon,
    parse_time_ms,
    pending_chart_svg,
)
from chronoq.http.metrics import make_registry
from chronoq.http.scope import (
    console_topics,
    visible_groups,
    visible_pending,
    visible_pending_by_due,
    visible_statuses,
)
from chronoq.protocol import admin as codec
from chronoq.protocol.admin import details_json
from chronoq.server.admin_service import AdminService
from chronoq.server.auth import Principal
from chronoq.server.net import bind_failure
from chronoq.timer.recall import encode_recall_handle
from chronoq.validate import check_key, check_message_id

if TYPE_CHECKING:
    from chronoq.broker import Broker  # the type only: the broker imports the store, the servers stay light

log = logging.getLogger(__name__)
HTTP2_PREFACE_MARK = "PRI"
"""aiohttp's parse error for a request line `PRI * HTTP/2.0` (an HTTP/2 client's preface) names it."""

MAX_CANCEL_BODY_BYTES = 4096
"""A cancel request is a topic and a message id; anything larger is refused unread."""
NOT_FOUND_ERRORS = frozenset({"TopicNotFound", "MessageNotFound", "TimerNotFound"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Unauthorized as err:
        # The browser asks the person for an access key and secret key, then sends them with
        # every request to this origin (the page's own fetches included).
        reply = _json({"error": type(err).__name__, "message": err.message}, 401)
        reply.headers["WWW-Authenticate"] = 'Basic realm="chronoq console", charset="UTF-8"'
        return reply
    except ChronoqError as err:
        name = type(err).__name__
        status = 403 if isinstance(err, Forbidden) else 404 if name in NOT_FOUND_ERRORS else \
            503 if err.retriable else 400
        return _json({"error": name, "message": err.message, "details": details_json(err)}, status)
    except Exception:
        log.exception("HTTP %s %s failed", request.method, request.path)
        return _json({"error": "InternalError", "message": "internal error; see the server log"}, 500)


class ConnectionLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's connection-level logger (its `RequestHandler.logger`), with one change: a request
    that fails to parse because it is an HTTP/2 preface (a gRPC client given the HTTP port) is one
    WARNING line naming the gRPC port, where aiohttp logs the parse error with its traceback. Every
    other record passes through as aiohttp wrote it."""

    def __init__(self, logger: logging.Logger, grpc_port: Callable[[], int]) -> None:
        super().__init__(logger, {})
        self._grpc_port = grpc_port

    def log(self, level: int, msg: object, *args: Any, exc_info: Any = None, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        if exc is not None and type(exc).__name__ == "BadHttpMessage" and HTTP2_PREFACE_MARK in str(exc):
            port = self._grpc_port()
            where = f"port {port}" if port else "the port `chronoq serve` prints first"
            log.warning("a gRPC (HTTP/2) client connected to the HTTP port from %s, which serves the "
                                "console, /metrics and /healthz over HTTP/1.1; gRPC is on %s",
                                args[0] if args else "an unknown address", where)
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)


class HttpServer:
    def __init__(self, broker: Broker, config: Config, admin: AdminService, access: Access | None = None) -> None:
        self.broker = broker
        self.config = config
        self.admin = admin
        self.access = access or Access(admin.auth)
        self.registry = make_registry(broker)
        self.admin_methods = {
            "ListTopics": admin.list_topics, "Stats": admin.stats, "QueryMessage": admin.query_message,
            "CancelMessage": admin.cancel_message, "SearchTimers": admin.search_timers,
            "PendingByDue": admin.pending_by_due,
        }
        self.history = ErrorHistory(broker.timer_latencies().delivery_error_ms, config.console_history_samples)
        self.starting = True
        """Until `serve` sets it False, once its gRPC port serves: an HTTP readiness probe must not
        say ready before a gRPC client can be answered."""
        self.stopping = False
        self.port = 0
        self.grpc_port = config.port
        """The gRPC port, named in the log line for a gRPC client that connects here (`serve` sets
        the bound one once it listens)."""
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=MAX_CANCEL_BODY_BYTES)
        static = resources.files("chronoq.http") / "static"
        app.router.add_get("/", self.index)
        app.router.add_static("/static/", str(static), show_index=False)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/api/topics", self.topics)
        app.router.add_get("/api/overview", self.overview)
        app.router.add_get("/api/message", self.message)
        app.router.add_post("/api/cancel", self.cancel)
        app.router.add_get("/api/search", self.search)
        app.router.add_get("/chart/pending.svg", self.pending_chart)
        app.router.add_get("/chart/error.svg", self.error_chart)
        return app

    async def start(self) -> int:
        """Bind and serve; returns the bound port. A port that cannot be bound is a ConfigError."""
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False,
                               logger=ConnectionLog(logging.getLogger("aiohttp.server"), lambda: self.grpc_port))
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.http_port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            why = bind_failure(self.config.host, self.config.http_port).replace("--port", "--http-port")
            raise ConfigError(f"cannot bind the HTTP port {self.config.http_port}: {why}") from None
        self._runner = runner
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self.config.http_port
        return self.port

    async def run(self) -> None:
        """The sampler behind the delivery-error chart, until cancelled."""
        await self.history.run(self.broker.clock, self.config.console_sample_interval_ms)

    async def stop(self) -> None:
        self.stopping = True
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # -- operators' endpoints ------------------------------------------------------------------

    async def metrics(self, request: web.Request) -> web.Response:
        self.access.check(request, "admin")  # every topic's and group's name: a broker-wide view
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def not_ready_reason(self) -> str | None:
        broker = self.broker
        if broker.fatal is not None:
            return f"the broker failed: {broker.fatal!r}; it refuses all work and is stopping"
        if self.stopping or broker.closed:
            return "shutting down"
        if self.starting:
            return "starting: the gRPC port does not serve yet"
        disk = broker.disk_stats()
        if disk["min_free_bytes"] and disk["free_bytes"] < disk["min_free_bytes"]:
            return (f"disk full: {disk['free_bytes']} bytes free, below disk_min_free_bytes "
                    f"({disk['min_free_bytes']}); sends are refused until space is freed")
        return None

    async def healthz(self, request: web.Request) -> web.Response:
        reason = self.not_ready_reason()
        if reason is None:
            return _json({"ready": True, "reason": "serving"})
        return _json({"ready": False, "reason": reason}, 503)

    # -- the console ---------------------------------------------------------------------------

    async def call(self, request: web.Request, role: Role, method: str, doc: dict[str, Any]) -> dict[str, Any]:
        """Every console read and action on the broker: the access check for `role`, then the
        admin service's method of that name (its gRPC name), in process. The one place where the
        caller's identity (auth on: the browser's credentials) reaches the admin service."""
        return await self.invoke(self.access.check(request, role), method, doc)

    async def invoke(self, caller: Principal, method: str, doc: dict[str, Any]) -> dict[str, Any]:
        """The admin service's method `method` for a caller `Access.check` has authenticated."""
        return await self.admin_methods[method](doc, caller)

    async def _topics(self, caller: Principal) -> dict[str, dict[str, Any]]:
        """The topics the caller may see (ListTopics: publish or subscribe; an admin, every one),
        by name in name order, the broker's own left out."""
        topics = {t["name"]: t for t in (await self.invoke(caller, "ListTopics", {}))["topics"]}
        return {name: topics[name] for name in console_topics(topics)}

    async def index(self, request: web.Request) -> web.Response:
        self.access.check(request, "read")
        page = (resources.files("chronoq.http") / "static" / "index.html").read_text(encoding="utf-8")
        return web.Response(text=page, content_type="text/html")

    async def topics(self, request: web.Request) -> web.Response:
        """Who the caller is and the topics it may see: what the console's topic drop-down lists,
        and whether it shows the admin views (with auth off every caller is the admin)."""
        caller = self.access.check(request, "read")
        return _json({"user": caller.name or None, "admin": caller.admin, "topics": list(await self._topics(caller))})

    async def overview(self, request: web.Request) -> web.Response:
        """The topics table, the timer summary and the consumer groups. An admin gets Stats whole;
        another user the same numbers for its own topics and groups (`http/scope.py`), without the
        broker-wide ones (every topic's next deadline, the delivery error): `null` for it."""
        caller = self.access.check(request, "read")
        topics = await self._topics(caller)
        # Stats is admin only (it spans every topic); a user's overview is the same reading, cut to its topics.
        stats = await self.invoke(caller, "Stats", {}) if caller.admin else self.broker.stats()
        timer = stats["timer"]
        pending = timer["pending_by_topic"]
        rows = [{"name": name, "queues": t.get("queue_count"), "pending": pending.get(name, 0),
                 "accepted": self.broker.accepted_by_topic.get(name, 0),
                 "delivered": self.broker.delivered_by_topic.get(name, 0)} for name, t in topics.items()]
        reply: dict[str, Any] = {
            "now_ms": stats["now_ms"], "now": format_utc(stats["now_ms"]), "admin": caller.admin, "topics": rows,
            "horizons": {name: h.label for name, h in HORIZONS.items()}}
        if caller.admin:
            reply.update(groups=stats["groups"], pending_total=timer["pending_total"],
                         pending_by_due=timer["pending_by_due"], next_deadline=format_utc(timer["next_deadline_ms"]),
                         oldest_overdue_ms=timer["oldest_overdue_ms"],
                         delivery_error_ms=timer["latencies"]["delivery_error_ms"])
        else:
            reply.update(groups=visible_groups(stats["groups"], caller),
                         pending_total=sum(n for topic, n in pending.items() if caller.may_see(topic)),
                         pending_by_due=None, next_deadline=None, oldest_overdue_ms=None, delivery_error_ms=None)
        return _json(reply)

    async def message(self, request: web.Request) -> web.Response:
        message_id = request.query.get("id", "").strip()
        key = request.query.get("key", "").strip()
        if not message_id and not key:
            raise ConsoleInputError("give a message id or a key to look up")
        caller = self.access.check(request, "read")
        if caller.admin:
            doc: dict[str, Any] = {"message_id": message_id} if message_id else {"key": key}
            statuses = (await self.invoke(caller, "QueryMessage", doc))["statuses"]
        else:
            # QueryMessage without a topic is admin only (it spans every topic): a user looks
            # up across the topics it may see, the same index read cut to them.
            found = self.broker.query(check_message_id(message_id, self.config)) if message_id \
                else self.broker.query_key(check_key(key))
            statuses = [codec.timer_status_json(s) for s in visible_statuses(found, caller)]
        if not statuses:
            what = f"message id {message_id!r}" if message_id else f"key {key!r}"
            return _json({"error": "NotFound", "message": f"no timer message with {what} (only scheduled and "
                                                          "delayed messages are kept in the time index)"}, 404)
        for s in statuses:
            for field in ("deliver_at_ms", "accepted_ms", "fired_ms", "cancelled_ms"):
                s[field.replace("_ms", "")] = format_utc(s[field])
        return _json({"statuses": statuses})

    async def cancel(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            # A cross-site form can post text/plain without asking; application/json needs the
            # browser's CORS preflight, which this server never grants.
            raise ConsoleInputError("a cancel request must be sent as application/json")
        try:
            doc = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise ConsoleInputError("the cancel request must be JSON: {\"topic\": ..., \"message_id\": ...}") \
                from None
        if not isinstance(doc, dict) or not doc.get("topic") or not doc.get("message_id"):
            raise ConsoleInputError("a cancel names the topic and the message id")
        args: dict[str, Any] = {"topic": doc["topic"], "message_id": doc["message_id"]}
        due_ms = doc.get("deliver_at_ms")
        if due_ms is not None and isinstance(doc["topic"], str) and isinstance(doc["message_id"], str):
            # A row names one timer: an id reused after the dedupe window names several, and a
            # cancel by id alone is refused for it (TimerIdAmbiguous). Its recall handle names it.
            try:
                if type(due_ms) is not int:
                    raise TypeError
                args = {"topic": doc["topic"],
                        "recall_handle": encode_recall_handle(doc["topic"], due_ms, doc["message_id"])}
            except (TypeError, struct.error, UnicodeEncodeError):
                raise ConsoleInputError("deliver_at_ms, when given, must be the timer's due time in epoch ms "
                                        "(an integer)") from None
        reply = await self.call(request, "admin", "CancelMessage", args)
        log.info("console: cancelled %s on %s", reply["message_id"], doc["topic"])
        return _json({"cancelled": reply["message_id"], "topic": doc["topic"]})

    async def search(self, request: web.Request) -> web.Response:
        caller = self.access.check(request, "read")
        now_ms = self.broker.now_ms()
        from_text, to_text = request.query.get("from", "now"), request.query.get("to", "")
        from_ms = parse_time_ms(from_text, now_ms, "from")
        to_ms = parse_time_ms(to_text, now_ms, "to")
        check_range(from_text, from_ms, to_text, to_ms, self.config.timer_search_max_range_ms)
        topic = request.query.get("topic") or None
        if topic is not None or caller.admin:
            doc: dict[str, Any] = {"topic": topic, "from_ms": from_ms, "to_ms": to_ms}
            reply = await self.invoke(caller, "SearchTimers", doc)
        else:
            # SearchTimers without a topic is admin only: a user searches the topics it may see.
            config = self.config
            entries, truncated = visible_pending(self.broker, caller, from_ms, to_ms, config.timer_search_max_rows,
                                                 config.timer_search_max_scanned)
            reply = {"timers": [codec.timer_entry_json(e) for e in entries], "truncated": truncated}
        for t in reply["timers"]:
            t["deliver_at"] = format_utc(t["deliver_at_ms"])
            t["accepted"] = format_utc(t["accepted_ms"])
        return _json({"timers": reply["timers"], "truncated": reply["truncated"], "from": format_utc(from_ms),
                      "to": format_utc(to_ms), "max_rows": self.config.timer_search_max_rows})

    async def pending_chart(self, request: web.Request) -> web.Response:
        h = horizon(request.query.get("horizon", "1h"))
        caller = self.access.check(request, "read")
        if caller.admin:
            reply = await self.invoke(caller, "PendingByDue", {"bar_s": h.bar_s, "bars": h.bars})
            svg = pending_chart_svg(reply["counts"], reply["from_s"], h, reply["before"], reply["after"])
        else:
            # PendingByDue is admin only (every topic's counters): a user's chart counts its own topics' timers.
            from_s = self.broker.now_ms() // 1000
            pending = self.broker.stats()["timer"]["pending_by_topic"]
            bars = visible_pending_by_due(self.broker, caller, pending, from_s, h.bar_s, h.bars,
                                          self.config.timer_search_max_scanned)
            svg = pending_chart_svg(bars.counts, from_s, h, bars.before, bars.after, bars.partial_from_ms,
                                    scope="your topics")
        return web.Response(text=svg, content_type="image/svg+xml", headers={"Cache-Control": "no-store"})

    async def error_chart(self, request: web.Request) -> web.Response:
        self.access.check(request, "admin")  # every topic's deliveries: broker-wide, like Stats
        svg = error_chart_svg(list(self.history.samples), self.config.console_sample_interval_ms)
        return web.Response(text=svg, content_type="image/svg+xml", headers={"Cache-Control": "no-store"})
