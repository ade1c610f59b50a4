"""``python -m gateway.bench``: the benchmark without the rest of the infermux CLI."""

from __future__ import annotations

import sys

from gateway.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
