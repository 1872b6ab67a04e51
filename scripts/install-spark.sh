#!/usr/bin/env bash
# Install what `chronoq spark ...` and tests/spark need, on Debian 12 (bookworm) or similar:
# a Java 17 runtime (from apt, if `java` is missing or older than 17) and the pinned Python
# packages into the project's venv. PySpark 4.3.0 comes from PyPI as a 456 MB sdist that pip
# builds locally (about a minute). Spark itself needs no network at run time.
#
# Usage: scripts/install-spark.sh [VENV]   (default: .venv next to this script's parent)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$here/.venv}"
pip="$venv/bin/pip"
python="$venv/bin/python"

if [[ ! -x "$pip" ]]; then
    echo "no venv at $venv (create it first: python3.11 -m venv $venv)" >&2
    exit 1
fi

java_major() {
    command -v java >/dev/null 2>&1 || { echo 0; return; }
    java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1
}

if [[ "$(java_major)" -lt 17 ]]; then
    echo "installing a Java 17 runtime (openjdk-17-jre-headless)"
    sudo_cmd=""
    [[ "$(id -u)" -ne 0 ]] && sudo_cmd="sudo"
    $sudo_cmd apt-get update
    $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openjdk-17-jre-headless
fi
echo "java: $(java -version 2>&1 | head -1)"

# protobuf is already a chronoq dependency; transformWithState needs it in the Python workers.
"$pip" install "pyspark==4.3.0" "pandas==2.3.3" "pyarrow==26.0.1" "matplotlib==3.11.2" "protobuf==7.36.2"

"$python" - <<'PY'
import pandas, pyarrow, pyspark, matplotlib
print(f"pyspark {pyspark.__version__}, pandas {pandas.__version__}, pyarrow {pyarrow.__version__}, "
      f"matplotlib {matplotlib.__version__}")
PY
echo "done. Run the Spark tests with: $venv/bin/pytest -m spark tests/spark"
