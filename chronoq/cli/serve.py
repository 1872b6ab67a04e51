"""`chronoq serve`: run the broker and its gRPC server until SIGTERM/SIGINT.

Theory of operation: configuration layers as `Config.load` defines them: defaults < the TOML file
(`--config`) < `CHRONOQ_*` environment variables < the flags given here. One line,
"chronoq serving on HOST:PORT", goes to stdout (flushed) once the port accepts calls, so scripts
and tests can wait for it; the next says whether auth is on ("chronoq auth on: N users" /
"chronoq auth off: ..."), with --http-port another names the console's URL, and with --pulsar-port
another the Pulsar door's ("chronoq pulsar door on pulsar://HOST:PORT"); logs go to
stderr (gRPC's own C-core log only with GRPC_VERBOSITY set:
`chronoq.cli.main`). Exit code 0 after a clean shutdown, 1 when the broker fails (or cannot open its
data directory), 2 when the start cannot go on as configured (a setting, an unknown `CHRONOQ_*`
variable, a TLS file, a port, a data directory that is a file or that another broker holds), each
said in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from chronoq.cli.common import add_command
from chronoq.config import Config, ConfigError
from chronoq.errors import ChronoqError, DataDirLocked
from chronoq.server.auth import AuthConfig, load_auth


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "serve", "run the broker (RocketMQ 5 gRPC protocol + chronoq admin)",
        "Run chronoq's broker and gRPC server until SIGTERM or SIGINT. Settings layer as defaults < --config "
        "TOML < CHRONOQ_<SETTING> environment variables < these flags (settings: chronoq/config.py); any other "
        "CHRONOQ_* variable but the clients' (CHRONOQ_SERVER, ...: chronoq/envvars.py) stops the start. Prints "
        "\"chronoq serving on HOST:PORT\" once it accepts calls.",
        ["chronoq serve --data-dir data", "chronoq serve --data-dir data --host 0.0.0.0 --port 9876",
         "chronoq serve --data-dir data --http-port 8090   # console on http://127.0.0.1:8090/",
         "chronoq serve --data-dir data --pulsar-port 6650   # Pulsar clients: pulsar://127.0.0.1:6650",
         "chronoq serve --data-dir data --tls-cert server.pem --tls-key server.key",
         "chronoq serve --data-dir data --config chronoq.toml   # [auth] enabled = true, [[auth.users]] ...",
         "CHRONOQ_TIMER_MAX_DELAY_MS=7776000000 chronoq serve --data-dir data   # 90 days"])
    p.add_argument("--data-dir", help="data directory (created if missing; default ./data)")
    p.add_argument("--port", type=int, help="gRPC port (default 8081)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, metavar="PORT",
                   help="also serve the web console, /metrics (Prometheus) and /healthz on this port (default: off)")
    p.add_argument("--pulsar-port", type=int, metavar="PORT",
                   help="also serve Apache Pulsar's binary protocol on this port, for Pulsar's clients (default: off)")
    p.add_argument("--config", metavar="FILE", help="TOML configuration file ([chronoq] table or top level)")
    p.add_argument("--tls-cert", metavar="FILE",
                   help="PEM certificate chain; enables TLS with --tls-key (clients then need --ca-cert or --tls)")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="what the log on stderr shows, in either case (default INFO)")
    p.set_defaults(func=run)


def load_auth_config(args: argparse.Namespace) -> AuthConfig:
    return load_auth(args.config)


def load_config(args: argparse.Namespace) -> Config:
    return Config.load(args.config, env=os.environ, data_dir=args.data_dir, port=args.port, host=args.host,
                       http_port=getattr(args, "http_port", None),  # callers may build args without it
                       pulsar_port=getattr(args, "pulsar_port", None),
                       tls_cert_file=args.tls_cert, tls_key_file=args.tls_key)


def run(args: argparse.Namespace) -> int:
    from chronoq.server.serve import install_signal_handlers, serve

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args)
        auth = load_auth_config(args)
    except OSError as exc:  # the --config file: missing, a directory, not readable
        what = f"--config {args.config}" if args.config else (exc.filename or "a configuration file")
        print(f"chronoq serve: cannot read {what}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as exc:
        print(f"chronoq serve: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        return await serve(config, stop=stop, on_ready=lambda line: print(line, flush=True), auth=auth,
                           own_process=True, auth_file=args.config)

    try:
        return asyncio.run(main())
    except ConfigError as exc:
        print(f"chronoq serve: {exc}", file=sys.stderr)
        return 2
    except DataDirLocked as exc:
        # Like a port in use: the start cannot go on as configured, and the fix is the operator's.
        print(f"chronoq serve: {exc}: stop that broker first, or give this one another --data-dir", file=sys.stderr)
        return 2
    except ChronoqError as exc:
        print(f"chronoq serve: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. no permission to create or write the data directory
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(config.data_dir) else ""
        print(f"chronoq serve: cannot use the data directory {config.data_dir}: {exc.strerror or exc}{where}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="chronoq")
    register(_parser.add_subparsers(dest="command", required=True))
    _args = _parser.parse_args()
    sys.exit(_args.func(_args))
