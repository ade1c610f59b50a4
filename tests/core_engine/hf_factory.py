"""Tiny random-weight Hugging Face models of each architecture, and the same weights as GGUF.

``tiny_hf_model("qwen3")`` builds a 2-layer model with ``transformers`` from a small config (no
download), its weights drawn so that activations stay O(1) (the library's own init would give
near-zero logits and a meaningless 1e-3 check). ``save_checkpoint(model, directory)`` writes it as a Hugging Face checkpoint directory
(``save_pretrained``'s config.json + model.safetensors, and a ``tokenizers`` tokenizer.json of
the same vocabulary). ``write_gguf(model, path)`` writes those weights
the way llama.cpp's converter lays them out (tensor names, q/k rows permuted for ``llama``
only), with the tiny byte-level BPE vocabulary of :mod:`tests.core_engine.gguf_factory`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from core_engine.chat.template import FALLBACK_CHATML_TEMPLATE
from tests.core_engine.gguf_factory import build_tiny_vocab

__all__ = ["ARCHITECTURES", "HF_ONLY_ARCHITECTURES", "WINDOW", "gguf_architecture", "save_checkpoint", "tiny_hf_model", "vocab_size", "write_gguf"]

#: The architectures the engine runs, as transformers builds them (each also as GGUF).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "qwen3moe", "mixtral", "gemma2", "gemma3")
#: Checkpoint-only ones: Mistral's sliding window is in its config.json; llama.cpp's converter
#: writes Mistral as a ``llama`` GGUF without it (and llama.cpp runs every layer over the whole
#: context), so there is no GGUF of the same model to compare.
HF_ONLY_ARCHITECTURES = ("mistral",)

#: The window of the tiny sliding-window models: well inside the tests' 64 positions and
#: across the engine's 16-token KV blocks.
WINDOW = 8

_PRE = {"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen2", "phi3": "llama3", "qwen3moe": "qwen2", "mixtral": "llama3",
        "gemma2": "qwen2", "gemma3": "qwen2", "mistral": "llama3"}
#: transformers' model_type (or our tiny model's name) -> the GGUF architecture name
#: (llama.cpp writes Mixtral and Mistral as ``llama``).
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "mistral": "llama", "gemma3_text": "gemma3"}


def gguf_architecture(arch: str) -> str:
    """The ``general.architecture`` a tiny ``arch`` model's GGUF has."""
    return _GGUF_ARCH.get(arch, arch)
_NUM_MERGES = 160


def _vocab(arch: str) -> tuple[list[str], list[int], list[str]]:
    """The tiny byte-level BPE vocabulary; Phi-3's also has its end-of-turn token ``<|end|>``
    (llama.cpp looks it up by name for that architecture)."""
    tokens, types, merges = build_tiny_vocab(_NUM_MERGES, _PRE[arch])
    if arch == "phi3":
        tokens, types = [*tokens, "<|end|>"], [*types, 3]
    return tokens, types, merges


def vocab_size(arch: str) -> int:
    return len(_vocab(arch)[0])


def tiny_hf_model(arch: str, *, seed: int = 0, **config_overrides: Any) -> Any:
    """A random-weight ``transformers`` causal LM of ``arch`` (fp32, eager attention);
    ``config_overrides`` go to its config (e.g. Phi-3's ``rope_scaling``)."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size(arch), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    gemma = {"tie_word_embeddings": True, "head_dim": 16, "query_pre_attn_scalar": 16,
             "sliding_window": WINDOW, "hidden_activation": "gelu_pytorch_tanh"}
    # Per architecture: its config class, its model class and what it sets beyond ``common``.
    own: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0, attention_bias=False)),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                  dict(rope_theta=1_000_000.0, use_sliding_window=False)),
        # head_dim 32 with hidden 64 and 4 heads: q is wider than the hidden size, as in Qwen3.
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                  dict(head_dim=32, rope_theta=1_000_000.0, attention_bias=False)),
        # 4 experts of 32, 2 per token: the router's choice varies across tokens and positions.
        "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
            head_dim=16, rope_theta=1_000_000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        )),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
            intermediate_size=32, rope_theta=10000.0, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        )),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                    dict(rope_theta=10000.0, sliding_window=WINDOW)),
        # Small soft-caps so that they bend these scores and logits (Gemma 2's real ones are
        # 50 and 30); query_pre_attn_scalar = head_dim, as llama.cpp assumes below 27B.
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                   gemma | dict(rope_theta=10000.0, attn_logit_softcapping=4.0, final_logit_softcapping=8.0)),
        # Six layers: five local ones and a global one, each with its own RoPE (the global one
        # linearly scaled).
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, gemma | dict(
            num_hidden_layers=6,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
                 dict(rope_theta=10000.0, sliding_window=None, pad_token_id=0, bos_token_id=0, eos_token_id=2)),
    }
    if arch not in own:
        raise ValueError(f"no tiny {arch!r} model")
    config_class, cls, fields = own[arch]
    config = config_class(**(common | fields | config_overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma's norms multiply by 1 + w
                offset = 0.0 if arch.startswith("gemma") else 1.0
                param.copy_(offset + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            else:
                scale = (2.0 if "embed" in name or "lm_head" in name else 1.5) / param.shape[-1] ** 0.5
                param.copy_(scale * torch.randn(param.shape, generator=gen))
    return model


def _permute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for ``llama`` q/k rows (its interleaved RoPE)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model: Any, path: str | Path) -> Path:
    """``model``'s weights (F32) and config as a GGUF llama.cpp and the engine both load."""
    cfg = model.config
    arch = _GGUF_ARCH.get(cfg.model_type, cfg.model_type)
    path = Path(path)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    tokens, token_types, merges = _vocab(cfg.model_type if cfg.model_type == "mixtral" else arch)
    assert len(tokens) == cfg.vocab_size

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-random")  # llama.cpp special-cases some names (a "phi3" one fails to load)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    if cfg.model_type in ("qwen3_moe", "mixtral"):
        writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if cfg.model_type == "qwen3_moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if arch != "gemma3":
        rope_theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
        writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    longrope = _longrope(cfg)
    if longrope is not None:
        writer.add_rope_scaling_orig_ctx_len(longrope["original"])
        writer.add_rope_scaling_attn_factors(longrope["attn_factor"])
    writer.add_vocab_size(cfg.vocab_size)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":  # the global layers' RoPE; llama.cpp gives the local ones base 10,000
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(float(full["rope_theta"]))
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_PRE[arch])
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(FALLBACK_CHATML_TEMPLATE)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if arch in ("gemma2", "gemma3"):  # llama.cpp's converter stores Gemma's norms as 1 + w
        state = {k: v + 1.0 if "norm" in k else v for k, v in state.items()}
    permute = arch == "llama"  # Mixtral too: llama.cpp writes it as llama
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    if longrope is not None:
        writer.add_tensor("rope_factors_long.weight", longrope["long"])
        writer.add_tensor("rope_factors_short.weight", longrope["short"])
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"blk.{i}."
        names = {
            "input_layernorm.weight": "attn_norm.weight",
            "self_attn.q_proj.weight": "attn_q.weight",
            "self_attn.k_proj.weight": "attn_k.weight",
            "self_attn.v_proj.weight": "attn_v.weight",
            "self_attn.q_proj.bias": "attn_q.bias",
            "self_attn.k_proj.bias": "attn_k.bias",
            "self_attn.v_proj.bias": "attn_v.bias",
            "self_attn.q_norm.weight": "attn_q_norm.weight",
            "self_attn.k_norm.weight": "attn_k_norm.weight",
            "self_attn.qkv_proj.weight": "attn_qkv.weight",
            "self_attn.o_proj.weight": "attn_output.weight",
            "mlp.gate_up_proj.weight": "ffn_up.weight",
            # Gemma: post_attention_layernorm follows attention; pre_feedforward_layernorm
            # is its FFN norm.
            "post_attention_layernorm.weight": "post_attention_norm.weight" if arch.startswith("gemma") else "ffn_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
            "mlp.gate_proj.weight": "ffn_gate.weight",
            "mlp.up_proj.weight": "ffn_up.weight",
            "mlp.down_proj.weight": "ffn_down.weight",
        }
        for hf_name, gguf_name in names.items():
            if src + hf_name not in state:
                continue
            tensor = state[src + hf_name]
            if permute and hf_name.startswith("self_attn.q_proj"):
                tensor = _permute_qk(tensor, heads)
            elif permute and hf_name.startswith("self_attn.k_proj"):
                tensor = _permute_qk(tensor, kv_heads)
            writer.add_tensor(dst + gguf_name, np.ascontiguousarray(tensor))
        if src + "mlp.gate.weight" in state:  # experts, stacked (E, rows, cols) as llama.cpp stores them
            gate, up = np.split(state[src + "mlp.experts.gate_up_proj"], 2, axis=1)
            writer.add_tensor(dst + "ffn_gate_inp.weight", state[src + "mlp.gate.weight"])
            writer.add_tensor(dst + "ffn_gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(dst + "ffn_up_exps.weight", np.ascontiguousarray(up))
            writer.add_tensor(dst + "ffn_down_exps.weight", state[src + "mlp.experts.down_proj"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _longrope(cfg: Any) -> dict[str, Any] | None:
    """What llama.cpp's converter (``Phi3MiniModel``) writes for a LongRoPE config: the original
    context, ``attn_factor`` from the trained over the original context (a config's own
    ``attention_factor`` is not read), and the two factor sets as F32 tensors."""
    import math

    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") not in ("longrope", "su"):
        return None
    original = rope["original_max_position_embeddings"]
    scale = cfg.max_position_embeddings / original
    return {
        "original": original,
        "attn_factor": math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0,
        "long": np.array(rope["long_factor"], dtype=np.float32),
        "short": np.array(rope["short_factor"], dtype=np.float32),
    }


def save_checkpoint(model: Any, directory: str | Path) -> Path:
    """``model`` as a checkpoint directory: config.json, model.safetensors, tokenizer.json
    (byte-level BPE over the tiny vocabulary, ChatML control tokens), tokenizer_config.json
    (chat template, BOS/EOS texts) and generation_config.json."""
    import json

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from core_engine.tokenizer.pre_tokenizer import _QWEN2
    from tests.core_engine.gguf_factory import SPECIAL_TOKENS

    directory = Path(directory)
    model.save_pretrained(str(directory), safe_serialization=True)
    name = model.config.model_type
    tokens, _, merges = _vocab({"qwen3_moe": "qwen3moe", "gemma3_text": "gemma3"}.get(name, name))
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(_QWEN2), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [*SPECIAL_TOKENS, *(["<|end|>"] if "<|end|>" in tokens else [])]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[2], "chat_template": FALLBACK_CHATML_TEMPLATE,
    }))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 0}))
    return directory


def train_tiny(model: Any, ids: list[int], *, steps: int = 150, seq_len: int = 128, seed: int = 0) -> Any:
    """``model`` trained (AdamW, in place) to predict ``ids``: a model that has learnt its text
    predicts it with clear margins, so quantisation and arithmetic differences between two
    engines rarely flip its top token, as with a real model (a random one's near-ties do).
    Returns the model in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(ids)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len, (4,), generator=gen)
        batch = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()
