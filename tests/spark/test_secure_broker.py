"""The Spark side against a broker with TLS and auth on: the executors' clients get the CA and keys.

Before, the Spark pipeline spoke plaintext with no credentials, so a broker with TLS or auth on
could not be used at all. The CA travels as PEM text in the options (an executor elsewhere has no
file), the keys as options too; a publish-only user can schedule, an admin reads, no keys: refused.
"""

from __future__ import annotations

import datetime as dt
import subprocess
from pathlib import Path

import pytest

from tests.support.extras import need_module

need_module("pyspark", "spark")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

pytestmark = pytest.mark.spark

AUTH_TOML = """
[auth]
enabled = true

[[auth.users]]
access_key = "scheduler"
secret_key = "sched-secret"
publish = ["secure"]

[[auth.users]]
access_key = "ops"
secret_key = "0ps-secret"
admin = true
"""


def _openssl_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "server.pem", directory / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory):
    from chronoq.client.testing import ServerProcess

    base = tmp_path_factory.mktemp("secure")
    cert, key = _openssl_cert(base)
    (base / "auth.toml").write_text(AUTH_TOML)
    proc = ServerProcess(base / "data", settings={"tls_cert_file": str(cert), "tls_key_file": str(key)},
                         args=["--config", str(base / "auth.toml")], tls_root_certificates=cert.read_bytes(),
                         access_key="ops", secret_key="0ps-secret").start()
    try:
        yield proc.address, cert.read_text()
    finally:
        proc.stop()


def test_schedule_and_read_over_tls_with_auth(spark, secure_server, tmp_path):
    from chronoq.client import Admin, Producer
    from chronoq.spark.datasource import SOURCE_NAME, BrokerAccess, register
    from chronoq.spark.schedule import ScheduleOptions, ScheduleSendError, run_schedule

    address, ca = secure_server
    admin_access = BrokerAccess(address, tls=True, ca_cert=ca, access_key="ops", secret_key="0ps-secret")
    with Admin(address, **admin_access.client_kwargs()) as admin:
        admin.create_topic("secure", queue_count=1)
    due = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    table = pa.table({"rid": [f"t{i}" for i in range(5)], "text": ["x"] * 5,
                      "at": pa.array([due] * 5, pa.timestamp("ms", tz="UTC"))})
    pq.write_table(table, tmp_path / "in.parquet")

    def options(access: BrokerAccess) -> ScheduleOptions:
        return ScheduleOptions(input_path=str(tmp_path / "in.parquet"), topic="secure", server=address,
                               deliver_at_column="at", body_column="text", id_column="rid",
                               connection=access.options())

    # No keys (TLS only): the broker refuses, and the failure is one line naming why.
    with pytest.raises(ScheduleSendError, match=r"failed after 0 messages of this task were accepted: Unauthorized"):
        run_schedule(spark, options(BrokerAccess(address, tls=True, ca_cert=ca)))

    publisher = BrokerAccess(address, tls=True, ca_cert=ca, access_key="scheduler", secret_key="sched-secret")
    result = run_schedule(spark, options(publisher))
    assert (result.scheduled, result.rejected) == (5, 0)
    with Admin(address, **admin_access.client_kwargs()) as admin:
        assert int(admin.stats()["timer"]["pending_by_topic"]["secure"]) == 5
        assert [t.state for t in admin.query("t3", "secure")] == ["pending"]

    with Producer(address, **publisher.client_kwargs()) as producer:
        producer.send("secure", b"now")
    register(spark)
    read = spark.read.format(SOURCE_NAME).options(**admin_access.options()).option("topic", "secure").load()
    assert [bytes(r.body) for r in read.collect()] == [b"now"]
