"""py-spy profiles of a Python server (chronoq, the floor) during a phase, summarised as top functions.

Theory of operation: `py-spy record --format raw` attaches to the server's pid from outside (no
change to the server, no import of py-spy in it) and writes collapsed stacks when it gets SIGINT.
The summary ranks functions by samples spent in them (self) and under them (inclusive), which
is enough to say where the time goes; the raw file stays beside it for a flame graph
(e.g. `inferno-flamegraph` or speedscope).
"""

from __future__ import annotations

import shutil
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench.harness.procs import ChildProcess, Server

PROFILED_SYSTEMS = {"chronoq", "chronoq-async", "chronoq-stream", "chronoq-wheel", "chronoq-pulsar",
                    "chronoq-pulsar-delay-all", "floor"}
PROFILED_PHASES = {"accept", "precision", "burst"}
SAMPLE_RATE_HZ = 100
TOP = 25


def _py_spy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def start(ph: Any, server: Server) -> ChildProcess | None:
    """Profile the server (chronoq's and the floor's only: the other peers are not Python)."""
    if ph.peer.name not in PROFILED_SYSTEMS:
        return None
    return start_pid(ph, server.procs[0].pid, "server")


def start_pid(ph: Any, pid: int, label: str) -> ChildProcess | None:
    """Profile any Python process of the phase (the server, or a consumer worker of any system)."""
    if not ph.cfg.profile or ph.name not in PROFILED_PHASES:
        return None
    exe = _py_spy()
    if exe is None:
        raise RuntimeError("--profile needs py-spy (pip install py-spy==0.4.3)")
    out = ph.log_dir / f"py-spy-{ph.name}-{label}.txt"
    argv = [exe, "record", "--pid", str(pid), "--format", "raw", "--output", str(out),
            "--rate", str(SAMPLE_RATE_HZ), "--nonblocking"]
    proc = ChildProcess("py-spy", argv, ph.log_dir / f"py-spy-{label}.log")
    proc.extra_label = label  # type: ignore[attr-defined]
    return proc


def finish(ph: Any, profiler: ChildProcess) -> dict[str, Any]:
    profiler.terminate(signal.SIGINT)
    label = getattr(profiler, "extra_label", "server")
    raw = ph.log_dir / f"py-spy-{ph.name}-{label}.txt"
    if not raw.exists():
        return {"error": f"py-spy wrote no profile; see {profiler.log_path}"}
    summary = summarise(raw)
    (ph.log_dir / f"py-spy-{ph.name}-{label}-top.txt").write_text(format_summary(summary))
    return {"raw": str(raw), **{k: v[:10] for k, v in summary.items() if isinstance(v, list)},
            "samples": summary["samples"]}


def summarise(raw: Path) -> dict[str, Any]:
    self_count: Counter[str] = Counter()
    incl_count: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        n = int(count_text)
        total += n
        frames = [_short(f) for f in stack.split(";")]
        if frames:
            self_count[frames[-1]] += n
        for f in set(frames):
            incl_count[f] += n

    def pct(c: Counter[str]) -> list[tuple[str, float]]:
        return [(f, round(100.0 * n / total, 1)) for f, n in c.most_common(TOP)] if total else []

    return {"samples": total, "self_pct": pct(self_count), "inclusive_pct": pct(incl_count)}


def _short(frame: str) -> str:
    """'func (path/to/module.py:123)' -> 'func (module.py)': lines split one function into many."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(Path(path).parts[-2:])})" if path else name


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"samples: {summary['samples']}", "", "self %:"]
    lines += [f"  {p:5.1f}  {f}" for f, p in summary["self_pct"]]
    lines += ["", "inclusive %:"]
    lines += [f"  {p:5.1f}  {f}" for f, p in summary["inclusive_pct"]]
    return "\n".join(lines) + "\n"
