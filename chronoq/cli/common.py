"""What every `chronoq` subcommand shares: consoles, exit statuses, connection flags, optional parts.

Theory of operation: a subcommand reports a failure a person can act on by raising `CliError`
(or a `chronoq.errors.ChronoqError` from the SDK); `chronoq.cli.main` prints it as one line on
stderr and exits with its status, so no command prints a traceback for a mistake. Exit statuses,
the same for every command (README, "Exit statuses"):

    0    done
    1    refused or failed: the server said no, it could not be reached, or an optional part
         the command needs is not installed (the message names the set-up step)
    2    usage: bad arguments or environment (argparse's own), a CA file that is not a
         certificate, a path that is not what the command needs
    3    `chronoq check` only: repairable (a restart repairs without loss)
    130  interrupted (Ctrl-C)

Connection flags follow kubectl's and nats's habit: every client command takes them, each has a
`CHRONOQ_*` environment variable as its default, and a flag beats the variable. `--ca-cert`
implies `--tls`, as trusting a CA means nothing without it.

Optional parts (the Spark extra: pyspark, pyarrow, pandas, matplotlib, and Java) are imported by
the commands that need them, after `require_*` has checked for them and, if one is missing, named
the set-up step that installs it (`scripts/setup.sh --spark`), instead of a ModuleNotFoundError.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import shutil
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from chronoq import envvars
from chronoq.errors import ChronoqError, Unauthorized

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

SERVER_ENV = envvars.SERVER
TLS_ENV = envvars.TLS
CA_CERT_ENV = envvars.CA_CERT
TLS_SERVER_NAME_ENV = envvars.TLS_SERVER_NAME
ACCESS_KEY_ENV = envvars.ACCESS_KEY
SECRET_KEY_ENV = envvars.SECRET_KEY
SPARK_SETUP = "scripts/setup.sh --spark"
"""The set-up step that installs the Spark extra (and Java 17) into the checkout's .venv."""
SPARK_MODULES = ("pyspark", "pyarrow", "pandas", "matplotlib")
"""What `pip install 'chronoq[spark]'` brings; each `chronoq spark` command needs all of them."""

# soft_wrap: a message line or an error is one line however narrow the terminal (greppable).
console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


class CliError(Exception):
    """A failure to report in one line and exit with `exit_status`."""

    exit_status = EXIT_FAILED

    def __init__(self, message: str, exit_status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if exit_status is not None:
            self.exit_status = exit_status


class UsageError(CliError):
    exit_status = EXIT_USAGE


class MissingPart(CliError):
    """An optional part the command needs is not installed (exit status 1)."""


def describe_error(e: ChronoqError) -> str:
    """'error (TopicNotFound, code 40402): ...': the class, code and retriable flag a script or a
    person needs to decide what next, then the message."""
    details = [type(e).__name__] + ([f"code {e.code}"] if e.code else []) + (["retriable"] if e.retriable else [])
    hint = ""
    if isinstance(e, Unauthorized):  # the server's words are for any client; say where this one takes keys
        hint = f"; the CLI takes keys as --access-key and --secret-key, or ${ACCESS_KEY_ENV} and ${SECRET_KEY_ENV}"
    return f"error ({', '.join(details)}): {e.message}{hint}"


def run_remote(body: Callable[[], Awaitable[int]]) -> int:
    """Run one command's coroutine; a chronoq error becomes a one-line message and exit 1."""
    try:
        return asyncio.run(body())
    except ChronoqError as e:
        err_console.print(describe_error(e), markup=False)
        return EXIT_FAILED


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that an "examples:" block keeps its lines as written (the
    description is wrapped to the terminal as usual)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:\n"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def add_command(subparsers: Any, name: str, summary: str, description: str, examples: Sequence[str] = (),
                **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand whose `--help` opens with what it does and ends with examples, as gh's does."""
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples) if examples else None
    return subparsers.add_parser(name, help=summary, description=description, epilog=epilog,
                                 formatter_class=HelpFormatter, **kwargs)


# -- the connection -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Connection:
    """Where and how a client command connects, after flags and environment are layered."""

    server: str
    tls: bool = False
    root_certificates: bytes | None = None
    tls_server_name: str | None = None
    access_key: str = ""
    secret_key: str = ""

    def client_kwargs(self) -> dict[str, Any]:
        return {"server": self.server, "tls": self.tls, "root_certificates": self.root_certificates,
                "tls_server_name": self.tls_server_name, "access_key": self.access_key,
                "secret_key": self.secret_key}


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection", "each flag defaults to its CHRONOQ_* environment variable")
    group.add_argument("--server", default=None, metavar="HOST:PORT",
                       help=f"chronoq server (default: ${SERVER_ENV} or 127.0.0.1:8081)")
    group.add_argument("--tls", action="store_true", default=None,
                       help=f"connect with TLS, trusting the system's CAs (default: ${TLS_ENV}=1)")
    group.add_argument("--ca-cert", default=None, metavar="FILE",
                       help=f"PEM certificate of the CA to trust, e.g. a self-signed server's own; implies --tls "
                            f"(default: ${CA_CERT_ENV})")
    group.add_argument("--tls-server-name", default=None, metavar="NAME",
                       help=f"name the server's certificate must carry, when it is not the host in --server "
                            f"(default: ${TLS_SERVER_NAME_ENV})")
    group.add_argument("--access-key", default=None, metavar="KEY",
                       help=f"access key of a user in the server's [auth] table (default: ${ACCESS_KEY_ENV})")
    group.add_argument("--secret-key", default=None, metavar="SECRET",
                       help=f"its secret key (default: ${SECRET_KEY_ENV}; prefer the variable: a flag shows in ps)")


def _env_flag(name: str, env: Mapping[str, str]) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise UsageError(f"${name} must be 1/true/yes/on or 0/false/no/off, not {env[name]!r}")


def read_ca_cert(path: str) -> bytes:
    """The PEM bytes of a CA file, refused with the reason when it cannot be one (a private key
    given by mistake, a missing file): gRPC would only say the handshake failed."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read the CA certificate {path}: {e.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        what = "a private key" if b"PRIVATE KEY-----" in data else "no PEM certificate"
        raise UsageError(f"{path} holds {what}; --ca-cert takes the PEM certificate of the CA that signed the "
                         "server's certificate (for a self-signed server, its certificate file)")
    return data


def connection_of(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Connection:
    from chronoq.client import InvalidArgument, default_server  # the SDK: for client commands only
    from chronoq.client.aio import parse_server

    env = os.environ if env is None else env
    server = getattr(args, "server", None) or env.get(SERVER_ENV) or default_server()
    try:
        parse_server(server)
    except InvalidArgument as e:
        source = "--server" if getattr(args, "server", None) else f"${SERVER_ENV}"
        raise UsageError(f"{source} {server!r} must be HOST:PORT with a port in 1-65535, e.g. 127.0.0.1:8081 "
                         f"({e.details['reason']})") from None
    ca_cert = getattr(args, "ca_cert", None) or env.get(CA_CERT_ENV) or None
    server_name = getattr(args, "tls_server_name", None) or env.get(TLS_SERVER_NAME_ENV) or None
    tls = bool(getattr(args, "tls", None)) or _env_flag(TLS_ENV, env) or ca_cert is not None or server_name is not None
    access_key = getattr(args, "access_key", None) or env.get(ACCESS_KEY_ENV) or ""
    secret_key = getattr(args, "secret_key", None) or env.get(SECRET_KEY_ENV) or ""
    if access_key and not secret_key:
        raise UsageError(f"--access-key needs its secret key: --secret-key or ${SECRET_KEY_ENV}")
    return Connection(server, tls, read_ca_cert(ca_cert) if ca_cert else None, server_name, access_key, secret_key)


# -- optional parts -----------------------------------------------------------------------------


def require_modules(command: str, modules: Sequence[str], part: str = "the Spark extra") -> None:
    """Import each of `modules`; if any is missing, raise `MissingPart` naming all missing ones
    and the set-up step (an import, not a lookup: a broken install fails here too, not later)."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise MissingPart(
            f"`chronoq {command}` needs {', '.join(missing)} ({part}), not installed in this Python "
            f"({sys.executable}). Install it with `{SPARK_SETUP}` in the chronoq checkout "
            "(or `pip install 'chronoq[spark]'`)")


def require_java(command: str) -> None:
    """Spark runs on a JVM: without `java`, pyspark fails with JAVA_GATEWAY_EXITED after a wait."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return
    if shutil.which("java") is None:
        raise MissingPart(f"`chronoq {command}` runs Apache Spark, which needs Java 17: no `java` on PATH and "
                          f"JAVA_HOME is {'not a JDK' if java_home else 'unset'}. `{SPARK_SETUP}` installs it "
                          "(apt-get, as root)")


def require_spark(command: str) -> None:
    require_modules(command, SPARK_MODULES)
    require_java(command)
