"""The web console writes counts and durations as the CLI does (`chronoq.timefmt`).

`console.js`'s `count` and `duration` run in Node (the page's other code waits for the DOM, so a
stub `document` is enough) and are compared with `timefmt.duration` for the same values. Before,
the page showed '1234567 timers pending' and 'p99 86400000 ms'. Needs Node.js (`scripts/setup.sh
--node`, or Debian's nodejs); skipped without it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import chronoq
from chronoq import timefmt
from tests.support.extras import need_command

CONSOLE_JS = Path(chronoq.__file__).parent / "http" / "static" / "console.js"
DAY_MS = 86_400_000
VALUES_MS = [0, 12, 999, 1000, 1250, 59_999, 60_000, 243_000, 3_600_000, 11_520_000, DAY_MS,
             2 * DAY_MS + 3 * 3_600_000, 30 * DAY_MS, 2520 * DAY_MS, -1250]


def test_console_counts_and_durations_read_as_the_clis() -> None:
    node = need_command("node", "nodejs", extra="node")
    script = (
        "const vm = require('vm');"
        "const ctx = {document: {addEventListener() {}}};"
        f"vm.runInNewContext(require('fs').readFileSync({json.dumps(str(CONSOLE_JS))}, 'utf8'), ctx);"
        f"console.log(JSON.stringify({{durations: {json.dumps(VALUES_MS)}.map(v => ctx.duration(v)),"
        "counts: [0, 999, 1234567].map(v => ctx.count(v)).concat([ctx.count(null)])}));")
    out = json.loads(subprocess.run([node, "-e", script], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    assert out["durations"] == [timefmt.duration(v) for v in VALUES_MS]
    assert out["counts"] == ["0", "999", "1,234,567", "-"]
