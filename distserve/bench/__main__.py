"""python -m distserve.bench ..."""

import sys

from distserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
