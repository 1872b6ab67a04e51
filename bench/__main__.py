"""`python -m bench`: run the side-by-side benchmark (see bench.harness.cli)."""

import sys

from bench.harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
