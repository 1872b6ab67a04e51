import sys

from chronoq.cli import main

sys.exit(main())
