"""The model's forward contract: incremental decoding, chunked prefill and the attention seam."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor

from core_engine.attention import AttentionContext, ContiguousAttention, LayerAttention
from core_engine.gguf_loader import load_model
from core_engine.model import LlamaConfig, LlamaModel
from core_engine.tokenizer import Tokenizer
from tests.core_engine.gguf_factory import TinyLlamaSpec, write_llama_gguf

TEXT = "The quick brown fox jumps over the lazy dog. def forward(self): return 12345"


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # The dev machine is shared: one intra-op thread is faster and steadier than two.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaModel, LlamaConfig, Tokenizer]:
    path = write_llama_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")
    return load_model(path, dtype=torch.float32, show_progress=False)


def _prefill(model: LlamaModel, ids: list[int], attn: ContiguousAttention, start: int = 0) -> Tensor:
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(start, start + len(ids)), attn)


def test_decode_one_token_at_a_time_equals_full_prefill(tiny: tuple[LlamaModel, LlamaConfig, Tokenizer]) -> None:
    model, config, tok = tiny
    ids = tok.encode(TEXT)
    full = _prefill(model, ids, ContiguousAttention(config.num_layers))  # (T, vocab)
    attn = ContiguousAttention(config.num_layers, initial_capacity=4)  # forces cache growth
    steps = [_prefill(model, [t], attn, start=i)[0] for i, t in enumerate(ids)]
    assert full.dtype == torch.float32 and full.shape == (len(ids), config.vocab_size)
    torch.testing.assert_close(torch.stack(steps), full, atol=1e-4, rtol=1e-4)
    assert attn.num_tokens == len(ids)


def test_chunked_prefill_equals_full_prefill(tiny: tuple[LlamaModel, LlamaConfig, Tokenizer]) -> None:
    model, config, tok = tiny
    ids = tok.encode(TEXT)
    full = _prefill(model, ids, ContiguousAttention(config.num_layers))
    attn = ContiguousAttention(config.num_layers)
    chunks = [_prefill(model, ids[i : i + 7], attn, start=i) for i in range(0, len(ids), 7)]
    torch.testing.assert_close(torch.cat(chunks), full, atol=1e-4, rtol=1e-4)


def test_logits_indices_select_rows(tiny: tuple[LlamaModel, LlamaConfig, Tokenizer]) -> None:
    model, config, tok = tiny
    ids = tok.encode(TEXT)
    full = _prefill(model, ids, ContiguousAttention(config.num_layers))
    wanted = torch.tensor([0, len(ids) - 1, 3])
    with torch.inference_mode():
        picked = model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(config.num_layers), logits_indices=wanted)
    torch.testing.assert_close(picked, full[wanted])


def test_truncate_rewinds_the_cache(tiny: tuple[LlamaModel, LlamaConfig, Tokenizer]) -> None:
    model, config, tok = tiny
    ids = tok.encode(TEXT)
    attn = ContiguousAttention(config.num_layers)
    first = _prefill(model, ids, attn)
    attn.truncate(5)
    again = _prefill(model, ids[5:], attn, start=5)
    torch.testing.assert_close(again, first[5:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="num_tokens"):
        attn.truncate(len(ids) + 1)


class RecordingAttention:
    """An AttentionContext that checks the contract the serving engine relies on."""

    def __init__(self, config: LlamaConfig) -> None:
        self.config = config
        self.inner = ContiguousAttention(config.num_layers)
        self.layers: list[int] = []

    def forward(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, spec: LayerAttention | None = None
    ) -> Tensor:
        cfg = self.config
        num_tokens = q.shape[0]
        assert q.shape == (num_tokens, cfg.num_heads, cfg.head_dim)
        assert k.shape == v.shape == (num_tokens, cfg.num_kv_heads, cfg.head_dim)
        self.layers.append(layer_idx)
        return self.inner.forward(layer_idx, q, k, v, spec)


def test_model_calls_the_attention_context_once_per_layer(tiny: tuple[LlamaModel, LlamaConfig, Tokenizer]) -> None:
    model, config, tok = tiny
    ids = tok.encode(TEXT)
    recorder = RecordingAttention(config)
    assert isinstance(recorder, AttentionContext)
    logits = _prefill(model, ids, recorder)  # type: ignore[arg-type]
    assert recorder.layers == list(range(config.num_layers))
    torch.testing.assert_close(logits, _prefill(model, ids, ContiguousAttention(config.num_layers)))


def test_bf16_model_tracks_fp32(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf", spec=TinyLlamaSpec(num_layers=2))
    fp32, config, tok = load_model(path, dtype=torch.float32, show_progress=False)
    bf16, _, _ = load_model(path, dtype=torch.bfloat16, show_progress=False)
    ids = tok.encode(TEXT)
    ref = _prefill(fp32, ids, ContiguousAttention(config.num_layers))
    low = _prefill(bf16, ids, ContiguousAttention(config.num_layers))
    assert low.dtype == torch.float32  # logits always come back in fp32
    assert (low - ref).abs().max() < 0.05 * ref.abs().max()
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
