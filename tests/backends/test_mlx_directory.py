"""An MLX-format model directory (``config.json``, safetensors, tokenizer files) via mlx-lm's loader.

The directory is written from the default GGUF (the same quantized weights, the Hugging Face
tokenizer ``transformers`` builds from the file), so the directory path and the GGUF path
must generate the same text.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import mlx.core as mx
import pytest
import pytest_asyncio
from mlx.utils import tree_flatten
from transformers import AutoTokenizer

from backends.base import BackendConfig, ChatMessage, GenerationRequest, SamplingParams
from backends.default_model import default_model_path
from backends.mlx import create_backend
from backends.mlx.backend import MLXBackend
from backends.mlx.gguf_loader import load_gguf_model

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


def write_mlx_directory(gguf_path: Path, directory: Path) -> Path:
    """What ``mlx_lm.convert`` would write for this model, from its GGUF."""
    loaded = load_gguf_model(gguf_path)
    args = loaded.args
    directory.mkdir()
    mx.save_safetensors(
        str(directory / "model.safetensors"), dict(tree_flatten(loaded.model.parameters()))
    )
    config = {
        "model_type": "llama",
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_theta": args.rope_theta,
        "rope_traditional": True,  # the GGUF's q/k row order
        "tie_word_embeddings": args.tie_word_embeddings,
        "quantization": {"group_size": 32, "bits": 4},  # per-layer bits are inferred
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backends(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[MLXBackend, MLXBackend]]:
    directory = write_mlx_directory(default_model_path(), tmp_path_factory.mktemp("m") / "smol")
    from_gguf = create_backend(BackendConfig(name="gguf", kind="mlx", options={"n_ctx": 512}))
    from_directory = create_backend(
        BackendConfig(name="dir", kind="mlx", options={"model_path": str(directory), "n_ctx": 512})
    )
    await from_gguf.start()
    await from_directory.start()
    yield from_gguf, from_directory
    await from_gguf.aclose()
    await from_directory.aclose()


async def test_directory_and_gguf_generate_the_same_text(
    backends: tuple[MLXBackend, MLXBackend],
) -> None:
    request = GenerationRequest(
        request_id="r",
        model="smollm2",
        kind="chat",
        messages=(ChatMessage(role="user", content="Name a big city in Japan. Ünïcödé ✓"),),
        params=SamplingParams(max_tokens=8, temperature=0, logprobs=True),
    )
    texts = []
    for backend in backends:
        chunks = [c async for c in backend.generate(request)]
        assert chunks[-1].usage is not None
        texts.append(("".join(c.text for c in chunks), chunks[-1].usage.prompt_tokens))
        entries = [e for c in chunks for e in (c.logprobs or ())]
        assert "".join(e.token for e in entries) == texts[-1][0]
    assert texts[0] == texts[1]
    assert texts[0][0].strip()
    directory = backends[1]
    assert directory.model_info().id == "smol"
    assert "<|im_start|>" in (directory.model_info().chat_template or "")
