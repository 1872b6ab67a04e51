#!/usr/bin/env bash
# A Spark standalone cluster on this host (a master and two workers on 127.0.0.1), for running
# `chronoq spark ...` against a real `spark://` master: chronoq/spark/cluster.py does the work,
# with the pyspark install's bin/spark-class (needs `scripts/setup.sh --spark`).
#
# Runs with $PYTHON if set, else the checkout's .venv/bin/python, else python3.
# Usage: scripts/spark-cluster.sh start|stop|status [--dir DIR] [--workers N] [--cores C] [--memory M] [--port P]
#   start   prints the master URL once every worker has registered, e.g. spark://127.0.0.1:7077
#   stop    ends the processes `start` began (recorded in DIR/state.json)
# Example:
#   master=$(scripts/spark-cluster.sh start --port 7077)
#   chronoq spark schedule --master "$master" --input reminders.parquet --topic reminders ...
#   scripts/spark-cluster.sh stop
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m chronoq.spark.cluster "$@"
