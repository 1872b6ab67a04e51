"""`chronoq serve`: run the broker and its gRPC server until SIGTERM/SIGINT.

Theory of operation: configuration layers as `Config.load` defines them: defaults < the TOML file
(`--config`) < `CHRONOQ_*` environment variables < the flags given here. One line,
"chronoq serving on HOST:PORT", goes to stdout (flushed) once the port accepts calls, so scripts
and tests can wait for it; logs go to stderr. Exit code 0 after a clean shutdown, 1 when the broker fails
(or cannot open its data directory), 2 on a configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from chronoq.config import Config, ConfigError
from chronoq.errors import ChronoqError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the broker (RocketMQ 5 gRPC protocol + chronoq admin)",
                              description="Run chronoq's broker and gRPC server until SIGTERM or SIGINT.")
    p.add_argument("--data-dir", help="data directory (created if missing)")
    p.add_argument("--port", type=int, help="gRPC port (default 8081)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--config", metavar="FILE", help="TOML configuration file ([chronoq] table or top level)")
    p.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain; enables TLS with --tls-key")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=run)


def load_config(args: argparse.Namespace) -> Config:
    return Config.load(args.config, env=os.environ, data_dir=args.data_dir, port=args.port, host=args.host,
                       tls_cert_file=args.tls_cert, tls_key_file=args.tls_key)


def run(args: argparse.Namespace) -> int:
    from chronoq.server.serve import install_signal_handlers, serve

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"chronoq serve: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        return await serve(config, stop=stop, on_ready=lambda line: print(line, flush=True))

    try:
        return asyncio.run(main())
    except ConfigError as exc:
        print(f"chronoq serve: {exc}", file=sys.stderr)
        return 2
    except ChronoqError as exc:  # e.g. DataDirLocked: another broker owns the directory
        print(f"chronoq serve: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="chronoq")
    register(_parser.add_subparsers(dest="command", required=True))
    _args = _parser.parse_args()
    sys.exit(_args.func(_args))
