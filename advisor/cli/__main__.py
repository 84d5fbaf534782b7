"""`python -m advisor.cli`: what the tests and the benches run (training workers run trainer/worker.py)."""

import sys

from advisor.cli import app

if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
