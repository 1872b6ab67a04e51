"""The input of the bulk-scheduling figure (`docs/performance.md`, "Spark"): 1,000,000 reminder rows in Parquet.

Each row is due 2 to 3 days after the generation (nothing fires during the run); every 200th row
is due 40 days ahead (beyond `--max-delay-ms`, rejected `too_far`), every 500th (from row 1) has no
body (rejected `body_missing`). Needs pyarrow (the `spark` extra).

    .venv/bin/python -m bench.gen_reminders /tmp/reminders.parquet
"""

from __future__ import annotations

import random
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq

ROWS = 1_000_000
DAY_MS = 86_400_000


def main(path: str) -> None:
    now = int(time.time() * 1000)
    rng = random.Random(7)
    due = [now + 40 * DAY_MS if i % 200 == 0 else now + 2 * DAY_MS + rng.randrange(DAY_MS) for i in range(ROWS)]
    text = [None if i % 500 == 1 else f"reminder {i}: pay the invoice" for i in range(ROWS)]
    pq.write_table(pa.table({"reminder_id": [f"r{i:07d}" for i in range(ROWS)], "remind_at": due, "text": text}), path)


if __name__ == "__main__":
    main(sys.argv[1])
