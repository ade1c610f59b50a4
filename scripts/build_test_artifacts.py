#!/usr/bin/env python
"""Build the test suite's cached artifacts once (``make test`` runs this before pytest).

- the tiny model of each architecture trained on a text, as an F32 GGUF, for
  ``tests/core_engine/test_quantized_architectures.py`` (``tests/core_engine/trained_tiny.py``
  says what each file is and the key it is cached under);
- the tiny models with a real vocabulary and chat template of llama.cpp's corpus, for
  ``tests/e2e/test_real_vocab_models.py``;
- SmolLM2 requantised by llama.cpp to the file types ``tests/core_engine/test_tensor_types.py``
  compares.

All in ``$INFERMUX_CACHE_DIR/test-artifacts`` (default ``~/.cache/infermux/test-artifacts``;
:mod:`tests.artifact_cache`). An artifact whose inputs have not changed is not rebuilt, so a
second run takes a few seconds.

    .venv/bin/python scripts/build_test_artifacts.py            # all of them
    .venv/bin/python scripts/build_test_artifacts.py gemma3     # one trained architecture
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.artifact_cache import cache_dir  # noqa: E402
from tests.core_engine.trained_tiny import ARCHITECTURES, build  # noqa: E402


@contextlib.contextmanager
def _stderr_to(log: Path) -> Iterator[None]:
    """File descriptor 2 (C libraries' logs included) appended to ``log`` meanwhile."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _report(what: str, make: Callable[[], tuple[Path, bool]]) -> None:
    started = time.perf_counter()
    with _stderr_to(cache_dir() / "build.log"):  # llama.cpp's quantiser logs every tensor
        path, built = make()
    took = f"built in {time.perf_counter() - started:.0f} s" if built else "cached"
    print(f"{what}: {path} ({path.stat().st_size / 2**20:.1f} MiB, {took})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", nargs="*", metavar="ARCH",
                        help=f"architectures to build (default: all of {', '.join(ARCHITECTURES)})")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.arch) - set(ARCHITECTURES))
    if unknown:
        parser.error(f"argument ARCH: unknown {', '.join(unknown)}; one of {', '.join(ARCHITECTURES)}")
    for arch in args.arch or ARCHITECTURES:
        _report(f"tiny {arch} (trained)", lambda arch=arch: build(arch))  # type: ignore[misc]
    if args.arch:
        return 0
    from tests.core_engine.test_tensor_types import SMOLLM2_FILE_TYPES, smollm2_as
    from tests.e2e.test_real_vocab_models import CASES, model_file

    for case in CASES:
        _report(f"real vocabulary {case.name}", lambda case=case: model_file(case))  # type: ignore[misc]
    for file_type in SMOLLM2_FILE_TYPES:
        _report(f"SmolLM2 {file_type}", lambda file_type=file_type: smollm2_as(file_type))  # type: ignore[misc]
    return 0


if __name__ == "__main__":
    sys.exit(main())
