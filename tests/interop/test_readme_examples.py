"""The README's examples for the official RocketMQ clients, run as written against a real `chronoq serve`.

Each example in README.md's "Using the official RocketMQ clients" is a fenced block preceded by
`<!-- official-client: NAME -->`; this module reads them from the README (so an edited example is
the one tested) and runs each in the official client's own process: Python examples with
`rocketmq-python-client` (never beside chronoq's own generated modules: no PYTHONPATH into
chronoq), JavaScript with `rocketmq-client-nodejs` from tests/interop/node. The only change made to
an example is the server's address (`127.0.0.1:8081` becomes the test server's port); each must
name that address, so an example pointing elsewhere fails here. The plain examples run against a
server without auth or TLS; the `-tls-auth` ones against one with a self-signed certificate
(`server.pem` in the example's working directory) and the README's `[auth]` users. The
wrong-credential case the README describes (what the Python client raises, logs, and what the
server logs) is the TLS example with its secret key changed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import chronoq
from chronoq.client.testing import ServerProcess
from tests.support.extras import missing, need_command

pytestmark = [pytest.mark.interop, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
README = Path(chronoq.__file__).resolve().parent.parent / "README.md"
NODE_MODULES = HERE / "node" / "node_modules"
README_ADDRESS = "127.0.0.1:8081"
RUN_TIMEOUT_S = 60
EXAMPLE = re.compile(r"<!-- official-client: (?P<name>[\w-]+) -->\n```(?P<lang>\w+)\n(?P<code>.*?)\n```\n", re.S)
EXPECTED = {"python-send", "python-receive", "python-tls-auth", "node-send", "node-receive", "node-tls-auth"}

AUTH_TOML = """
[auth]
enabled = true

[[auth.users]]
access_key = "orders-app"
secret_key = "s3cret"
publish = ["orders"]
subscribe = ["orders"]
groups = ["billing"]

[[auth.users]]
access_key = "auditor"
secret_key = "aud1t"
subscribe = ["orders"]

[[auth.users]]
access_key = "ops"
secret_key = "0ps-secret"
admin = true
"""


def examples() -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    for m in EXAMPLE.finditer(README.read_text()):
        assert m["name"] not in found, f"two README examples named {m['name']!r}"
        found[m["name"]] = (m["lang"], m["code"])
    return found


def test_the_readme_has_each_example_once() -> None:
    found = examples()
    assert set(found) == EXPECTED, sorted(found)
    for name, (lang, code) in found.items():
        assert lang == ("python" if name.startswith("python") else "javascript"), (name, lang)
        assert README_ADDRESS in code, f"{name} does not connect to {README_ADDRESS}"


def _run(name: str, address: str, cwd: Path, *,
         replace: tuple[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    lang, code = examples()[name]
    code = code.replace(README_ADDRESS, address)
    if replace is not None:
        assert replace[0] in code, (name, replace)
        code = code.replace(*replace)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")}
    env["HOME"] = str(cwd)  # the clients' own logs go under $HOME/logs
    if lang == "python":
        script = cwd / f"{name}.py"
        cmd = [sys.executable, str(script)]
    else:
        node = need_command("node", extra="node")
        if not (NODE_MODULES / "rocketmq-client-nodejs" / "package.json").exists():
            missing("node", "npm rocketmq-client-nodejs is not installed in tests/interop/node")
        env["NODE_PATH"] = str(NODE_MODULES)  # `require` finds the client from the example's own directory
        script = cwd / f"{name}.js"
        cmd = [node, str(script)]
    script.write_text(code + "\n")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = ServerProcess(tmp_path_factory.mktemp("readme-plain") / "data").start()
    try:
        yield proc.address
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """A TLS server with auth on, and the directory holding its self-signed `server.pem`."""
    base = tmp_path_factory.mktemp("readme-secure")
    cert, key = base / "server.pem", base / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    (base / "auth.toml").write_text(AUTH_TOML)
    proc = ServerProcess(base / "data", tls_root_certificates=cert.read_bytes(),
                         args=["--config", str(base / "auth.toml"), "--tls-cert", str(cert), "--tls-key", str(key)])
    with pytest.MonkeyPatch.context() as env:  # the readiness check (an admin call) signs as an admin
        env.setenv("CHRONOQ_ACCESS_KEY", "ops")
        env.setenv("CHRONOQ_SECRET_KEY", "0ps-secret")
        proc.start()
    try:
        yield proc, cert
    finally:
        assert proc.stop() == 0, proc.log()


def _workdir(tmp_path: Path, cert: Path | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    if cert is not None:
        (tmp_path / "server.pem").write_bytes(cert.read_bytes())
    return tmp_path


@pytest.mark.parametrize("client", ["python", "node"])
def test_timer_send_then_simple_consumer_receive_and_ack(plain_server: str, tmp_path: Path, client: str) -> None:
    sent = _ok(_run(f"{client}-send", plain_server, _workdir(tmp_path / "send")))
    sent_at = time.monotonic()
    match = re.match(r"sent (\w+) recall handle (\S+)", sent)
    assert match, sent
    message_id = match[1]
    received = _ok(_run(f"{client}-receive", plain_server, _workdir(tmp_path / "receive")))
    waited_s = time.monotonic() - sent_at
    assert f"received {message_id} " in received and "cancel order 1042 if unpaid" in received, received
    assert waited_s >= 4.5, f"the timer message (due in 5 s) arrived after {waited_s:.1f} s"
    # Acked: nothing is left for the group (the receive example would wait for it otherwise).
    left = subprocess.run([sys.executable, "-m", "chronoq", "consume", "orders", "--group", "billing", "--count", "1",
                           "--server", plain_server], capture_output=True, text=True, timeout=60,
                          check=False)
    assert message_id not in left.stdout, left.stdout


@pytest.mark.parametrize("client", ["python", "node"])
def test_tls_with_a_self_signed_certificate_and_credentials(secure_server: tuple[ServerProcess, Path], tmp_path: Path,
                                                            client: str) -> None:
    proc, cert = secure_server
    out = _ok(_run(f"{client}-tls-auth", proc.address, _workdir(tmp_path, cert)))
    assert re.fullmatch(r"sent \w+\n", out), out


def test_a_wrong_secret_key_as_the_readme_says(secure_server: tuple[ServerProcess, Path], tmp_path: Path) -> None:
    proc, cert = secure_server
    done = _run("python-tls-auth", proc.address, _workdir(tmp_path, cert), replace=('"s3cret"', '"wrong"'))
    assert done.returncode != 0
    assert "Exception: failed to fetch topic:orders route." in done.stderr, done.stderr[-2000:]
    client_log = (tmp_path / "logs" / "rocketmq_python" / "rocketmq_client.log").read_text()
    assert ("query topic raise exception, 40100, signature mismatch for access key 'orders-app' (wrong secret key?)"
            in client_log), client_log[-2000:]
    deadline = time.monotonic() + 5
    while "refused QueryRoute" not in proc.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    refused = [line for line in proc.log().splitlines() if "refused QueryRoute" in line]
    assert refused and "WARNING" in refused[0], proc.log()
    assert "40100 signature mismatch for access key 'orders-app' (wrong secret key?)" in refused[0], refused
    # The client's route refresh repeats the refusal; the server logs it once a minute.
    assert len(refused) == 1, refused


def test_node_wrong_secret_key_names_the_reason(secure_server: tuple[ServerProcess, Path], tmp_path: Path) -> None:
    proc, cert = secure_server
    done = _run("node-tls-auth", proc.address, _workdir(tmp_path, cert), replace=("'s3cret'", "'wrong'"))
    assert done.returncode != 0
    assert "Failed to fetch topic routes after 3 attempts" in done.stderr, done.stderr[-3000:]
    assert "response-code=40100] signature mismatch for access key 'orders-app' (wrong secret key?)" in done.stderr


def test_python_send_past_the_route_raises_the_status(secure_server: tuple[ServerProcess, Path],
                                                      tmp_path: Path) -> None:
    """The README: a refusal after the route (a user that may subscribe to the topic, not publish to
    it, gets the route) is raised by `send()` with the server's status."""
    proc, cert = secure_server
    done = _run("python-tls-auth", proc.address, _workdir(tmp_path, cert),
                replace=('Credentials("orders-app", "s3cret")', 'Credentials("auditor", "aud1t")'))
    assert done.returncode != 0
    assert "ForbiddenException: 40300, access key 'auditor' may not publish to topic 'orders'" in done.stderr, (
        done.stderr[-2000:])
