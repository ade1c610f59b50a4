#!/usr/bin/env python
"""Build the test suite's cached artifacts once (``make test`` runs this before pytest).

Today: the tiny model of each architecture trained on a text, as an F32 GGUF, for
``tests/core_engine/test_quantized_architectures.py`` (see ``tests/core_engine/trained_tiny.py``
for what each file is and the key it is cached under, in ``$INFERMUX_CACHE_DIR/test-artifacts``,
default ``~/.cache/infermux/test-artifacts``). An artifact whose inputs have not changed is not
rebuilt, so a second run takes about a second.

    .venv/bin/python scripts/build_test_artifacts.py            # all of them
    .venv/bin/python scripts/build_test_artifacts.py gemma3     # one architecture
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.core_engine.trained_tiny import ARCHITECTURES, build  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", nargs="*", metavar="ARCH",
                        help=f"architectures to build (default: all of {', '.join(ARCHITECTURES)})")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.arch) - set(ARCHITECTURES))
    if unknown:
        parser.error(f"argument ARCH: unknown {', '.join(unknown)}; one of {', '.join(ARCHITECTURES)}")
    for arch in args.arch or ARCHITECTURES:
        started = time.perf_counter()
        path, built = build(arch)
        took = f"trained in {time.perf_counter() - started:.0f} s" if built else "cached"
        print(f"tiny {arch}: {path} ({path.stat().st_size / 2**20:.1f} MiB, {took})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
