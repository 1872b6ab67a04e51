"""Every directory entry chronoq creates is made durable: its directory is fsynced afterwards.

A new file or directory survives a power loss only once the directory holding its name is
fsynced. Watched from outside with `strace -y` (system calls with the paths of their file
descriptors), a broker opens a fresh data directory, creates a topic, sends, rolls segments and
consume-queue files, checkpoints and closes; every mkdir and every rename into place under the
data directory must be followed by an fsync of the directory it was made in. RocksDB's own files
inside `groups/` and `timer/` are RocksDB's business; the `groups` and `timer` entries themselves
are chronoq's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from chronoq.broker import Broker
    from chronoq.clock import FakeClock
    from chronoq.config import Config
    from chronoq.model import OutgoingMessage

    async def main():
        config = Config(data_dir=sys.argv[1], segment_size_bytes=4096, max_message_size_bytes=2048,
                        consume_queue_entries_per_file=4, default_queue_count=2)
        broker = await Broker.open(config, clock=FakeClock(), background=False)
        await broker.create_topic("orders", 2)
        for i in range(30):
            await broker.send(OutgoingMessage("orders", b"x" * 200, message_id=f"m{i}"))
        await broker.send(OutgoingMessage("orders", b"timer", deliver_at_ms=broker.clock.now_ms() + 60_000))
        broker.store.checkpoint()
        await broker.close()

    asyncio.run(main())
""")

_CALL = re.compile(r"^(?:\[pid\s+\d+\]\s+|\d+\s+)?(\w+)\((.*)\)\s+=\s+(-?\d+)")
_STR = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD_PATH = re.compile(r"^\d+<(.*)>")


def _trace(data: Path, tmp_path: Path) -> list[tuple[str, list[str], str]]:
    """(syscall, string arguments or the fd's path, result) for each successful call."""
    out = tmp_path / "strace.txt"
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    subprocess.run(["strace", "-f", "-qq", "-y", "-s", "4096", "-o", str(out),
                    "-e", "trace=mkdir,mkdirat,rename,renameat,renameat2,fsync,fdatasync",
                    sys.executable, str(script), str(data)], check=True, timeout=120)
    calls = []
    for line in out.read_text().splitlines():
        m = _CALL.match(line)
        if m is None or int(m.group(3)) < 0:
            continue
        name, args = m.group(1), m.group(2)
        if name in ("fsync", "fdatasync"):
            fd = _FD_PATH.match(args)
            calls.append((name, [fd.group(1)] if fd else [], m.group(3)))
        else:
            calls.append((name, _STR.findall(args), m.group(3)))
    return calls


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (apt-get install strace)")
def test_every_entry_created_under_the_data_dir_is_fsynced_into_its_directory(tmp_path: Path) -> None:
    data = (tmp_path / "fresh" / "data").resolve()
    calls = _trace(data, tmp_path)
    assert sum(1 for name, _, _ in calls if name.startswith("mkdir")) >= 5, f"strace output not understood: {calls[:5]}"
    owned_by_rocksdb = [str(data / "groups") + "/", str(data / "timer") + "/"]
    pending: dict[str, str] = {}  # created path -> what created it, until its directory is fsynced
    for name, args, _ in calls:
        if (name.startswith("mkdir") and args) or (name.startswith("rename") and len(args) >= 2):
            created = [args[-1]]  # the new name: a directory made, or a file renamed into place
        elif name in ("fsync", "fdatasync") and args:
            synced = args[0]
            for path in [p for p in pending if str(Path(p).parent) == synced]:
                del pending[path]
            continue
        else:
            continue
        for path in created:
            path = str(Path(path))
            if not path.startswith(str(tmp_path)) or any(path.startswith(r) for r in owned_by_rocksdb):
                continue
            pending[path] = name
    assert (data / "commitlog").is_dir() and (data / "queues").is_dir(), "the script did not run as intended"
    assert not pending, "created but their directory never fsynced:\n" + "\n".join(
        f"  {p} ({how})" for p, how in sorted(pending.items()))
