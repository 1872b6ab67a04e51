"""Auth with the official RocketMQ clients, unmodified, each in its own process.

One `chronoq serve --config auth.toml` (auth on, three users) serves the module, plus one with TLS
for the TLS-and-auth case. The probe flows (`python_auth_flow.py`, `node/auth_flow.js`) try a
send, a timer send and its recall, and a receive, and report each step; the assertions live here:
right key (everything works), wrong key and no key (40100), a topic the user may not see (its
route is refused), a topic it may only subscribe to (its send is refused with 40300), a group it
may not use (40300), and the admin service and CLI refused to a non-admin (40300).

A refused route query is only logged by the clients ("failed to fetch topic route"); the code is
read from the client's own log (Python: `$HOME/logs/rocketmq_python`, the flow's HOME is a temp
directory; Node: the flow's logger).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import chronoq
from chronoq.client.testing import free_port
from tests.support.extras import missing, need_command

pytestmark = [pytest.mark.interop, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = Path(chronoq.__file__).resolve().parent.parent
NODE_DIR = HERE / "node"
FLOW_TIMEOUT_S = 90

AUTH_TOML = """
[auth]
enabled = true

[[auth.users]]
access_key = "orders-app"
secret_key = "s3cret"
publish = ["orders", "payments-*"]
subscribe = ["orders", "reports"]
groups = ["billing"]
admin = false

[[auth.users]]
access_key = "ops"
secret_key = "0ps-secret"
admin = true
"""




def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def _openssl_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "server.pem", directory / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def _start(base: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = base / "auth.toml"
    config.write_text(AUTH_TOML)
    log = open(base / "server.log", "wb")  # noqa: SIM115 (closed when the process ends)
    proc = subprocess.Popen([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(base / "data"), "--port",
                             str(port), "--config", str(config), *extra], stdout=subprocess.PIPE, stderr=log,
                            env=_env())
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith(f"chronoq serving on 127.0.0.1:{port}"):
        proc.kill()
        pytest.fail(f"chronoq serve did not come up: {line!r}\n{(base / 'server.log').read_text()[-3000:]}")
    return proc, f"127.0.0.1:{port}"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        assert proc.wait(timeout=20) == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("chronoq serve did not exit within 20 s of SIGTERM")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, address = _start(tmp_path_factory.mktemp("auth-interop"), [])
    try:
        yield address
    finally:
        _stop(proc)


def _python_flow(address: str, ak: str, sk: str, topic: str, group: str, home: Path, *, tls: bool = False,
                 ca: Path | None = None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HOME"] = str(home)  # the client's log goes to $HOME/logs/rocketmq_python
    if ca is not None:
        env["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = str(ca)
    done = subprocess.run([sys.executable, str(HERE / "python_auth_flow.py"), address, ak, sk, topic, group,
                           "1" if tls else "0"], capture_output=True, timeout=FLOW_TIMEOUT_S, env=env, check=False)
    lines = done.stdout.decode().strip().splitlines()
    assert lines, f"flow printed nothing (exit {done.returncode}); stderr:\n{done.stderr.decode()[-3000:]}"
    report = json.loads(lines[-1])
    assert "fatal" not in report, report["fatal"]
    log_file = home / "logs" / "rocketmq_python" / "rocketmq_client.log"
    return report, log_file.read_text() if log_file.exists() else ""


def _node_flow(address: str, ak: str, sk: str, topic: str, group: str) -> dict:
    node = need_command("node", extra="node")
    if not (NODE_DIR / "node_modules" / "rocketmq-client-nodejs" / "package.json").exists():
        missing("node", "npm rocketmq-client-nodejs is not installed in tests/interop/node")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([node, str(NODE_DIR / "auth_flow.js"), address, ak, sk, topic, group], cwd=NODE_DIR,
                          capture_output=True, timeout=FLOW_TIMEOUT_S, env=env, check=False)
    lines = done.stdout.decode().strip().splitlines()
    assert lines, f"flow printed nothing (exit {done.returncode}); stderr:\n{done.stderr.decode()[-3000:]}"
    report = json.loads(lines[-1])
    assert "fatal" not in report, report["fatal"]
    return report


ALL_STEPS = ("send", "send_timer", "recall", "receive")


def _ok(report: dict, *steps: str) -> None:
    for name in steps:
        assert report.get(name, {}).get("ok") is True, (name, report)


def _refused(report: dict, name: str, code: str) -> None:
    assert report.get(name, {}).get("ok") is False, (name, report)
    assert code in report[name]["error"], (name, report)


def test_python_right_key_works(server: str, tmp_path: Path) -> None:
    report, _ = _python_flow(server, "orders-app", "s3cret", "orders", "billing", tmp_path)
    _ok(report, *ALL_STEPS)
    assert report["received"] >= 1


@pytest.mark.parametrize(("ak", "sk", "why"), [("orders-app", "wrong", "signature mismatch"),
                                               ("", "", "no credentials"), ("stranger", "x", "unknown access key")],
                         ids=["wrong-key", "no-key", "unknown-user"])
def test_python_bad_credentials_get_40100(server: str, tmp_path: Path, ak: str, sk: str, why: str) -> None:
    report, log = _python_flow(server, ak, sk, "orders", "billing", tmp_path)
    for name in ("send", "receive"):
        assert report[name]["ok"] is False and "route" in report[name]["error"], report
    assert "40100" in log and why in log, log[-2000:]


def test_python_forbidden_topic_and_group_get_40300(server: str, tmp_path: Path) -> None:
    report, log = _python_flow(server, "orders-app", "s3cret", "refunds", "billing", tmp_path / "a")
    assert report["send"]["ok"] is False and report["receive"]["ok"] is False
    assert "40300" in log and "topic 'refunds'" in log
    # A topic it may subscribe to but not publish to: the route is given, the send refused.
    report, _ = _python_flow(server, "orders-app", "s3cret", "reports", "billing", tmp_path / "b")
    _refused(report, "send", "40300")
    _refused(report, "receive", "40402")  # past auth: nobody could create the topic
    report, _ = _python_flow(server, "orders-app", "s3cret", "orders", "audit", tmp_path / "c")
    _ok(report, "send", "recall")
    _refused(report, "receive", "40300")


def test_node_right_key_works(server: str) -> None:
    report = _node_flow(server, "orders-app", "s3cret", "payments-eu", "billing")
    _ok(report, "producer_startup", "send", "send_timer", "recall")
    report = _node_flow(server, "orders-app", "s3cret", "orders", "billing")
    _ok(report, *ALL_STEPS)


@pytest.mark.parametrize(("ak", "sk"), [("orders-app", "wrong"), ("", "")], ids=["wrong-key", "no-key"])
def test_node_bad_credentials_get_40100(server: str, ak: str, sk: str) -> None:
    report = _node_flow(server, ak, sk, "orders", "billing")
    assert report["producer_startup"]["ok"] is False and report["consumer_startup"]["ok"] is False, report
    assert any("response-code=40100" in line for line in report["log"]), report


def test_node_forbidden_topic_and_group_get_40300(server: str) -> None:
    report = _node_flow(server, "orders-app", "s3cret", "refunds", "billing")
    assert report["producer_startup"]["ok"] is False
    assert any("response-code=40300" in line for line in report["log"]), report
    report = _node_flow(server, "orders-app", "s3cret", "reports", "billing")
    _refused(report, "send", "40300")
    report = _node_flow(server, "orders-app", "s3cret", "orders", "audit")
    _refused(report, "receive", "40300")


def test_cli_admin_commands_need_the_admin_role(server: str) -> None:
    def cli(*args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-m", "chronoq", *args], capture_output=True, timeout=60,
                              env=dict(_env(), **env), check=False)

    refused = cli("--server", server, "--access-key", "orders-app", "--secret-key", "s3cret", "stats")
    assert refused.returncode == 1, refused.stderr
    assert b"error (Forbidden, code 40300): access key 'orders-app' may not call Stats (admin only)" in refused.stderr
    anonymous = cli("stats", "--server", server)
    assert anonymous.returncode == 1 and b"code 40100" in anonymous.stderr, anonymous.stderr
    allowed = cli("stats", "--server", server, CHRONOQ_ACCESS_KEY="ops", CHRONOQ_SECRET_KEY="0ps-secret")
    assert allowed.returncode == 0, allowed.stderr
    created = cli("topics", "create", "cli-made", "--server", server, CHRONOQ_ACCESS_KEY="orders-app",
                  CHRONOQ_SECRET_KEY="s3cret")
    assert created.returncode == 1 and b"40300" in created.stderr, created.stderr


def test_tls_and_auth_with_the_python_client(tmp_path: Path) -> None:
    cert, key = _openssl_cert(tmp_path)
    proc, address = _start(tmp_path, ["--tls-cert", str(cert), "--tls-key", str(key)])
    try:
        report, _ = _python_flow(address, "orders-app", "s3cret", "orders", "billing", tmp_path / "ok", tls=True,
                                 ca=cert)
        _ok(report, *ALL_STEPS)
        report, log = _python_flow(address, "orders-app", "wrong", "orders", "billing", tmp_path / "bad", tls=True,
                                   ca=cert)
        assert report["send"]["ok"] is False and "40100" in log
    finally:
        _stop(proc)
