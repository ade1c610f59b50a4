"""Hugging Face checkpoint directories (config.json, *.safetensors, tokenizer.json) as the
core engine's ``model_path``: each architecture against ``transformers``, the tokenizer
against ``tokenizers``, and the directory served through the gateway. Nothing is downloaded:
the checkpoints are tiny random-weight models the tests save."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from backends.base import BackendConfig
from core_engine.attention import ContiguousAttention
from core_engine.gguf_loader import load_model
from core_engine.hf_loader import HFLoadError, hf_config
from core_engine.tokenizer.hf import HFTokenizer
from gateway.testing import gateway_config, run_gateway
from tests.core_engine.engine_util import make_engine, run_all
from tests.core_engine.hf_factory import (
    ARCHITECTURES,
    HF_ONLY_ARCHITECTURES,
    WINDOW,
    gguf_architecture,
    save_checkpoint,
    tiny_hf_model,
)
from tests.core_engine.tokenizer_corpus import CORPUS

pytestmark = pytest.mark.slow

IDS = list(range(3, 67))


@pytest.fixture(scope="module", params=(*ARCHITECTURES, *HF_ONLY_ARCHITECTURES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object, Path]]:
    arch = request.param
    model = tiny_hf_model(arch, seed=1)
    yield arch, model, save_checkpoint(model, tmp_path_factory.mktemp(f"hf-{arch}"))


def test_logits_equal_transformers(checkpoint: tuple[str, object, Path]) -> None:
    arch, hf, directory = checkpoint
    model, config, _ = load_model(directory, dtype=torch.float32, show_progress=False)
    assert config.architecture == gguf_architecture(arch)
    with torch.inference_mode():
        ours = model(torch.tensor(IDS), torch.arange(len(IDS)), ContiguousAttention(config.num_layers)).float()
    with torch.no_grad():
        theirs = hf(torch.tensor([IDS])).logits[0].float()  # type: ignore[operator]
    assert ours.std() > 1.0 and (ours - theirs).abs().max() <= 1e-3, arch


def test_the_engine_decodes_what_transformers_generates_in_each_weight_format(checkpoint: tuple[str, object, Path]) -> None:
    arch, hf, directory = checkpoint
    prompt = IDS[:12]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()  # type: ignore[attr-defined]
    from core_engine.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert run_all(make_engine(directory), {"p": prompt}, greedy)["p"]["token_ids"] == expected, arch
    # The block formats quantise these weights at load (no GGUF blocks to take): they run.
    packed = make_engine(directory, weight_format="int8")
    assert packed.model_runner.model.weight_format == "int8"
    assert len(run_all(packed, {"p": prompt}, greedy)["p"]["token_ids"]) == 12


def test_the_tokenizer_is_the_checkpoints(checkpoint: tuple[str, object, Path]) -> None:
    from tokenizers import Tokenizer

    _, _, directory = checkpoint
    ours, theirs = HFTokenizer(directory), Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in CORPUS:
        assert ours.encode(text, parse_special=True) == theirs.encode(text).ids, text
        if "<|" not in text:
            assert ours.decode(ours.encode(text)) == text
    # Control-token texts in user input stay text unless asked for.
    assert ours.encode("<|im_start|>", parse_special=True) == [1]
    assert 1 not in ours.encode("<|im_start|>")
    # eos from generation_config.json, plus <|endoftext|>: an end-of-generation text, as llama.cpp treats it.
    end = ours.token_to_id("<|end|>")  # Phi-3's end of turn, in its vocabulary only
    assert ours.stop_token_ids == {0, 2, *([end] if end is not None else [])}
    assert ours.eos_token_id == 2 and ours.bos_token_id == 0
    assert ours.decode([1, *ours.encode("hi")]) == "hi" and ours.decode([1], skip_special=False) == "<|im_start|>"


def test_a_checkpoint_directory_is_served_through_the_gateway(checkpoint: tuple[str, object, Path]) -> None:
    arch, _, directory = checkpoint
    config = gateway_config(
        BackendConfig(name=arch, kind="core_engine", options={"model_path": str(directory), "num_threads": 1}),
        models={arch: [arch]},
    )
    messages = [{"role": "user", "content": "the quick brown fox " * 8}]
    fixed = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with run_gateway(config) as gateway:
        client = gateway.openai_client(timeout=120.0)
        first = client.chat.completions.create(model=arch, messages=messages, **fixed)
        assert first.usage.completion_tokens == 6
        chunks = list(client.chat.completions.create(
            model=arch, messages=messages, stream=True, stream_options={"include_usage": True}, **fixed,
        ))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content
        assert next(c.usage for c in chunks if c.usage).prompt_tokens_details.cached_tokens > 0


def test_an_unsupported_model_type_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 64}))
    with pytest.raises(
        HFLoadError, match=r"model_type 'gpt_neox' is not supported \(supported: gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe\)"
    ):
        hf_config(tmp_path)
    with pytest.raises(HFLoadError, match="no \\*.safetensors"):
        load_model(tmp_path, dtype=torch.float32)


def test_llama3_rope_scaling_of_a_checkpoint_matches_transformers(tmp_path: Path) -> None:
    # Llama 3.1's rope_type "llama3": per-pair frequency divisors. A short original context and
    # a low theta put most pairs in the scaled and interpolated bands, so the factors matter.
    import transformers

    from tests.core_engine.hf_factory import vocab_size

    config = transformers.LlamaConfig(
        vocab_size=vocab_size("llama"), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=500.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    )
    plain = tiny_hf_model("llama", seed=3)
    config._attn_implementation = "eager"
    scaled = transformers.LlamaForCausalLM(config).eval()
    scaled.load_state_dict(plain.state_dict())
    directory = save_checkpoint(scaled, tmp_path / "llama31")
    model, cfg, _ = load_model(directory, dtype=torch.float32, show_progress=False)
    with torch.inference_mode():
        ours = model(torch.tensor(IDS), torch.arange(len(IDS)), ContiguousAttention(cfg.num_layers)).float()
    with torch.no_grad():
        theirs, unscaled = (m(torch.tensor([IDS])).logits[0].float() for m in (scaled, plain))
    assert (ours - theirs).abs().max() <= 1e-3
    assert (theirs - unscaled).abs().max() > 0.05  # the scaling changes the logits here


def test_mixtral_checkpoints_in_the_hubs_per_expert_layout_load(tmp_path: Path) -> None:
    # Mixtral's published checkpoints name experts block_sparse_moe.experts.E.w1/w3/w2 (gate,
    # up, down) rather than transformers 5's stacked mlp.experts tensors: the same model.
    from safetensors.torch import save_file

    hf = tiny_hf_model("mixtral", seed=4)
    directory = save_checkpoint(hf, tmp_path / "mixtral")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    hub: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".mlp.experts.gate_up_proj" in name:
            prefix = name.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts.")
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                hub[f"{prefix}{e}.w1.weight"], hub[f"{prefix}{e}.w3.weight"] = gate.contiguous(), up.contiguous()
        elif ".mlp.experts.down_proj" in name:
            prefix = name.replace("mlp.experts.down_proj", "block_sparse_moe.experts.")
            for e, down in enumerate(tensor):
                hub[f"{prefix}{e}.w2.weight"] = down.contiguous()
        else:
            hub[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = tensor
    for f in directory.glob("*.safetensors"):
        f.unlink()
    save_file(hub, str(directory / "model.safetensors"))
    model, config, _ = load_model(directory, dtype=torch.float32, show_progress=False)
    with torch.inference_mode():
        ours = model(torch.tensor(IDS), torch.arange(len(IDS)), ContiguousAttention(config.num_layers)).float()
    with torch.no_grad():
        theirs = hf(torch.tensor([IDS])).logits[0].float()
    assert config.num_experts == 4 and (ours - theirs).abs().max() <= 1e-3



@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3"])
def test_a_sliding_window_is_applied_where_the_config_sets_it(arch: str, tmp_path: Path) -> None:
    # Mistral (every layer), Gemma 2 (every other one), Gemma 3 (five in six): the positions
    # before the window fills see the same keys with or without it, the later ones do not.
    import dataclasses

    directory = save_checkpoint(tiny_hf_model(arch, seed=1), tmp_path / arch)
    logits = []
    for keep_window in (True, False):
        model, config, _ = load_model(directory, dtype=torch.float32, show_progress=False)
        assert config.sliding_window == WINDOW and config.local_layers
        for layer in model.layers:
            if not keep_window and layer.attention_spec is not None:
                layer.attention_spec = dataclasses.replace(layer.attention_spec, window=None)
        with torch.inference_mode():
            logits.append(model(torch.tensor(IDS), torch.arange(len(IDS)), ContiguousAttention(config.num_layers)).float())
    windowed, whole = logits
    assert (windowed[:WINDOW] - whole[:WINDOW]).abs().max() <= 1e-5
    assert (windowed[WINDOW:] - whole[WINDOW:]).abs().amax(-1).min() > 1e-3, arch


@pytest.mark.parametrize("family", ["sentencepiece-bpe", "sentencepiece-unigram"])
def test_a_sentencepiece_style_tokenizer_json_is_read_as_tokenizers_reads_it(family: str, tmp_path: Path) -> None:
    # Llama 2, Mistral and Gemma checkpoints ship a Metaspace ("▁") BPE tokenizer.json, T5's a
    # unigram one: trained here by `tokenizers` on the corpus, with the ChatML control tokens.
    from tokenizers import Tokenizer
    from tokenizers.implementations import SentencePieceBPETokenizer, SentencePieceUnigramTokenizer

    from tests.core_engine.gguf_factory import SPECIAL_TOKENS

    trainer = SentencePieceBPETokenizer() if family.endswith("bpe") else SentencePieceUnigramTokenizer()
    trainer.train_from_iterator(list(CORPUS) * 3, vocab_size=500 if family.endswith("bpe") else 300,
                                special_tokens=list(SPECIAL_TOKENS))
    trainer.save(str(tmp_path / "tokenizer.json"))
    ours, theirs = HFTokenizer(tmp_path), Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in CORPUS:
        assert ours.encode(text, parse_special=True) == theirs.encode(text).ids, text
        ids = ours.encode(text, add_special=False)
        # A decoded continuation keeps the word boundary of its first piece ("▁Hello" is
        # " Hello", as llama.cpp detokenizes); tokenizers' decode drops that one space.
        assert ours.decode(ids) == (" " + theirs.decode(ids) if ids else ""), text
    start = theirs.token_to_id("<|im_start|>")
    assert ours.encode("<|im_start|>", parse_special=True) == [start]
    if family.endswith("bpe"):
        # Control-token texts in user input stay text. (Not so for this unigram file: its
        # trainer keeps the control texts as scored pieces, which `tokenizers`' Viterbi picks
        # inside plain text too; docs/models.md.)
        assert start not in ours.encode("<|im_start|>")
