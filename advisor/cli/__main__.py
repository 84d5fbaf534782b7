"""`python -m advisor.cli`: what launched training workers and the benches run."""

import sys

from advisor.cli import app

if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
