"""The `chronoq` command: one module per group of subcommands.

Theory of operation: each module in `COMMAND_MODULES` has `register(subparsers)`, which adds its
subcommands and sets `func(args) -> int` (the exit status) on each. `main` parses and
dispatches; nothing here knows what a subcommand does. It is also the one place a failure
becomes an exit status: a `CliError` (usage, a missing optional part) is printed as one line,
Ctrl-C is 130 (`chronoq.cli.common` lists the statuses).

gRPC's C core logs to stderr on its own ("E1123 ... add_port.cc:83] Failed to add port"), beside
the one-line messages chronoq prints for the same failures; `main` silences it unless the user
set GRPC_VERBOSITY. It reads the variable when grpc is first imported, so this happens before
any command module is.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from chronoq import __version__

COMMAND_MODULES = [  # in the order `chronoq --help` lists them: run it, use it, look after it
    "chronoq.cli.serve",
    "chronoq.cli.demo",
    "chronoq.cli.messages",
    "chronoq.cli.topics",
    "chronoq.cli.stats",
    "chronoq.cli.check",
    "chronoq.cli.trace",
    "chronoq.cli.spark",
    "chronoq.cli.bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chronoq", description="chronoq: a durable broker for scheduled and delayed messages.",
        epilog="Run `chronoq COMMAND --help` for a command's flags and examples. Client commands take "
               "--server, --tls and --ca-cert, or $CHRONOQ_SERVER, $CHRONOQ_TLS and $CHRONOQ_CA_CERT; with auth on, "
               "--access-key and --secret-key, or $CHRONOQ_ACCESS_KEY and $CHRONOQ_SECRET_KEY.")
    parser.add_argument("--version", action="version", version=f"chronoq {__version__}")
    # The connection flags also before the command (`chronoq --server H:P send ...`), as kubectl
    # and gh take theirs; kept under other names so a subcommand's own defaults cannot clobber them.
    for flag, kind in _GLOBAL_FLAGS.items():
        if kind is bool:
            parser.add_argument(flag, dest=_global_dest(flag), action="store_true", default=None,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=_global_dest(flag), default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


_GLOBAL_FLAGS = {"--server": str, "--tls": bool, "--ca-cert": str, "--tls-server-name": str, "--access-key": str,
                 "--secret-key": str}


def _global_dest(flag: str) -> str:
    return "global_" + flag.lstrip("-").replace("-", "_")


def _apply_global_flags(args: argparse.Namespace) -> None:
    """A connection flag given before the command counts unless the command got its own."""
    for flag in _GLOBAL_FLAGS:
        value = getattr(args, _global_dest(flag), None)
        name = flag.lstrip("-").replace("-", "_")
        if value is not None and getattr(args, name, None) is None:
            setattr(args, name, value)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from chronoq.cli.common import EXIT_INTERRUPTED, CliError, err_console

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not getattr(args, "passthrough", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.args = [*extra, *args.args]  # a pass-through command hands its arguments on whole
    _apply_global_flags(args)
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        command = " ".join(str(getattr(args, k)) for k in ("command", "topics_command", "spark_command",
                                                            "trace_command") if getattr(args, k, None))
        err_console.print(f"chronoq {command}: {e.message}", markup=False)
        return e.exit_status
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
