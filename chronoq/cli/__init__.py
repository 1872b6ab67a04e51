"""The `chronoq` command: one module per group of subcommands.

Theory of operation: each module in `COMMAND_MODULES` has `register(subparsers)`, which adds its
subcommands and sets `func(args) -> int` (the exit status) on each. `main` parses and
dispatches; nothing here knows what a subcommand does. It is also the one place a failure
becomes an exit status: a `CliError` (usage, a missing optional part) is printed as one line,
Ctrl-C is 130 (`chronoq.cli.common` lists the statuses). Every parser is a `Parser`, argparse's
with a newcomer's mistakes answered: a misspelled flag is reported by its command's parser with
the flag it resembles, a misspelled command with the command it resembles, and `--in -5s` reaches
the flag's own check.

gRPC's C core logs to stderr on its own ("E1123 ... add_port.cc:83] Failed to add port"), beside
the one-line messages chronoq prints for the same failures; `main` silences it unless the user
set GRPC_VERBOSITY. It reads the variable when grpc is first imported, so this happens before
any command module is.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from chronoq import __version__

COMMANDS = {  # each module and the commands it registers, in the order `chronoq --help` lists them
    "chronoq.cli.serve": ("serve",),
    "chronoq.cli.demo": ("demo",),
    "chronoq.cli.messages": ("send", "consume", "show", "cancel"),
    "chronoq.cli.topics": ("topics",),
    "chronoq.cli.schedules": ("schedule",),
    "chronoq.cli.stats": ("stats",),
    "chronoq.cli.check": ("check",),
    "chronoq.cli.trace": ("trace",),
    "chronoq.cli.spark": ("spark",),
    "chronoq.cli.bench": ("bench",),
}
COMMAND_MODULES = list(COMMANDS)
_MODULE_OF = {command: module for module, commands in COMMANDS.items() for command in commands}


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


class Parser(argparse.ArgumentParser):
    """argparse's parser, with three changes a newcomer notices (subcommands' parsers are of this
    class too, as argparse makes them of their parent's):

    - a value that starts with a minus and a digit (`--in -5s`) is a value, not an unknown flag,
      so it reaches the flag's own check ("a duration cannot be negative") instead of argparse's
      "expected one argument" (argparse does this for plain negative numbers only);
    - a mistyped command gets "did you mean 'send'?", and a missing one the help that lists them;
    - the innermost parser that left arguments over is kept, so `main` reports a misspelled flag
      with that command's usage and the flag it resembles (`--levle`: did you mean --level?).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d")  # argparse's own: r'^-\d+$|^-\d*\.\d+$'

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        if extra and not hasattr(parsed, "_parser_with_extra"):
            parsed._parser_with_extra = self
        return parsed, extra

    def error(self, message: str) -> Any:  # argparse's signature: NoReturn
        sub = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is not None and message == f"the following arguments are required: {sub.metavar or sub.dest}":
            self.print_help(sys.stderr)  # `chronoq` or `chronoq topics` alone: the list to choose from
            self.exit(2, f"{self.prog}: error: {message}\n")
        choice = _INVALID_CHOICE.search(message)
        if choice:
            close = difflib.get_close_matches(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)), n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        super().error(message)

    def unrecognized(self, extra: Sequence[str]) -> None:
        """Exit with usage status naming each unknown flag and, if one is close, the flag meant."""
        known = [flag[2:] for action in self._actions for flag in action.option_strings if flag.startswith("--")]
        hints = []
        for arg in extra:
            name = arg.split("=", 1)[0]
            # Compared without the dashes, which every flag shares and which would make any short
            # flag look close ('--tyme' is not '--at').
            close = difflib.get_close_matches(name.lstrip("-"), known, n=1, cutoff=0.7) if name.startswith("-") else []
            if close:
                hints.append(f"{name}: did you mean --{close[0]}?")
        self.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))


def build_parser(module: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of the one command `module` registers."""
    parser = Parser(
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
    for name in COMMAND_MODULES if module is None else [module]:
        importlib.import_module(name).register(sub)
    return parser


def command_module(argv: Sequence[str]) -> str | None:
    """The module of the command `argv` names, or None (no command, or one that is not known).
    Only that module is imported to run it: `chronoq serve` does not load the SDK's modules, nor
    `chronoq send` the server's. The flags before the command are the connection flags."""
    args = iter(argv)
    for arg in args:
        if arg in _GLOBAL_FLAGS and _GLOBAL_FLAGS[arg] is not bool:
            next(args, None)  # the flag's value
        elif not arg.startswith("-"):
            return _MODULE_OF.get(arg)
    return None


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

    parser = build_parser(command_module(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not getattr(args, "passthrough", False):
            getattr(args, "_parser_with_extra", parser).unrecognized(extra)
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
