"""Tiny random-weight Llama GGUF files that llama.cpp and core_engine both load (shared helper).

``write_llama_gguf(tmp_path / "tiny.gguf")`` writes a 2-layer, hidden-64 model with GQA
(4 heads, 2 kv heads), a byte-level BPE vocabulary of ~400 tokens (256 bytes, merges learned
from a small built-in corpus, ChatML control tokens) and a ChatML chat template. Every call with
the same arguments writes the same bytes. Weights can be stored as F32, F16, BF16, Q8_0, Q4_0
or Q4_1 (quantised with ``gguf.quants``).
``write_with_vocab(model, vocab, path)`` gives such a tiny model another file's vocabulary
(a real one from llama.cpp's corpus) and a chat template.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from core_engine.chat.template import FALLBACK_CHATML_TEMPLATE
from core_engine.tokenizer.byte_level import BYTE_TO_CHAR, encode_bytes
from core_engine.tokenizer.pre_tokenizer import PreTokenizer

__all__ = [
    "SPECIAL_TOKENS",
    "TinyLlamaSpec",
    "build_tiny_vocab",
    "write_dequantized_f32_copy",
    "write_llama_gguf",
    "write_with_vocab",
]

#: Control tokens at ids 0, 1, 2 (eos = <|im_end|>, bos = <|endoftext|>).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CORPUS = """
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun; the fox runs home.
def forward(self, input_ids, positions):
    return self.model(input_ids, positions)  # the model returns logits
In the beginning there were tokens, and the tokens were merged into words and the words into text.
Numbers like 12345 and 2024 appear in text, and so do emails like someone@example.com.
Hello world! Hello there, how are you today? I'm fine, thanks; we've been testing the tokenizer.
"""


@dataclass(frozen=True, kw_only=True)
class TinyLlamaSpec:
    """Shape and tokenizer settings of a generated model."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    context_length: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    num_merges: int = 160
    pre: str = "smollm"
    #: ``None`` leaves ``tokenizer.ggml.add_bos_token`` out (llama.cpp's per-pre default applies).
    add_bos: bool | None = True
    #: ``(kind, factor)`` written as ``llama.rope.scaling.type`` / ``.factor``.
    rope_scaling: tuple[str, float] | None = None
    architecture: str = "llama"
    seed: int = 0
    #: A SentencePiece model file: its pieces, scores and types become the vocabulary
    #: (``tokenizer.ggml.model = "llama"``, as Llama 2 / Mistral / Gemma files) instead of the
    #: byte-level BPE.
    sentencepiece_model: Path | None = None


def build_tiny_vocab(num_merges: int, pre: str = "smollm") -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a byte-level BPE trained greedily on a small corpus."""
    words = Counter(
        encode_bytes(word) for word in PreTokenizer("smollm" if pre == "smollm" else "gpt2").split(_CORPUS)
    )
    splits = {word: list(word) for word in words}
    merges: list[str] = []
    merged_tokens: list[str] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            parts = splits[word]
            for a, b in zip(parts, parts[1:], strict=False):
                pairs[(a, b)] += count
        if not pairs:
            break
        # Most frequent pair; ties broken by the pair's text so the vocab is deterministic.
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        merges.append(f"{a} {b}")
        merged_tokens.append(a + b)
        for word in words:
            parts, out, i = splits[word], [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            splits[word] = out
    tokens = [*SPECIAL_TOKENS, *BYTE_TO_CHAR, *dict.fromkeys(merged_tokens)]
    token_types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, token_types, merges


def sentencepiece_vocab(model_file: Path) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and GGUF token types of a SentencePiece model (as llama.cpp's converter
    writes them: normal 1, unknown 2, control 3, user-defined 4, byte 6)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    kinds = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}  # sentencepiece's Type enum matches GGUF's
    return ([p.piece for p in proto.pieces], [p.score for p in proto.pieces], [kinds[p.type] for p in proto.pieces])


def _encode_weight(array: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    if qtype == GGMLQuantizationType.F32:
        return array.astype(np.float32), None
    if qtype == GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_llama_gguf(
    path: str | Path,
    *,
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    spec: TinyLlamaSpec | None = None,
    omit: frozenset[str] = frozenset(),
) -> Path:
    """Write a random-weight Llama GGUF to ``path`` and return the path.

    Matrices (including the token embedding) use ``weight_type``; norms stay F32, as in
    llama.cpp's quantised files. q/k weights are random, so their llama.cpp row order needs no
    permutation here. Tensors named in ``omit`` are left out (to test loader errors).
    """
    spec = spec or TinyLlamaSpec()
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    if spec.sentencepiece_model is not None:
        tokens, scores, token_types = sentencepiece_vocab(spec.sentencepiece_model)
    else:
        tokens, token_types, merges = build_tiny_vocab(spec.num_merges, spec.pre)
    vocab = len(tokens)
    head_dim = spec.hidden_size // spec.num_heads
    hidden, inter = spec.hidden_size, spec.intermediate_size

    writer = gguf.GGUFWriter(str(path), spec.architecture)
    writer.add_name("tiny-random-llama")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(hidden)
    writer.add_block_count(spec.num_layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    if spec.rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(spec.rope_scaling[0]))
        writer.add_rope_scaling_factor(spec.rope_scaling[1])
    writer.add_vocab_size(vocab)
    if spec.sentencepiece_model is not None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(token_types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(spec.pre)
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
    if spec.add_bos is not None:
        writer.add_add_bos_token(spec.add_bos)
    writer.add_chat_template(FALLBACK_CHATML_TEMPLATE)

    def matrix(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    def add(name: str, array: np.ndarray) -> None:
        if name in omit:
            return
        if array.ndim == 1:
            writer.add_tensor(name, array.astype(np.float32))
            return
        data, raw_dtype = _encode_weight(array, weight_type)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)

    # Scales keep activations O(1) so logits spread over a few units: a meaningful 1e-3 check.
    add("token_embd.weight", matrix(vocab, hidden, 2.0 / hidden**0.5))
    for i in range(spec.num_layers):
        add(f"blk.{i}.attn_norm.weight", norm(hidden))
        add(f"blk.{i}.attn_q.weight", matrix(spec.num_heads * head_dim, hidden, 1.5 / hidden**0.5))
        add(f"blk.{i}.attn_k.weight", matrix(spec.num_kv_heads * head_dim, hidden, 1.5 / hidden**0.5))
        add(f"blk.{i}.attn_v.weight", matrix(spec.num_kv_heads * head_dim, hidden, 1.0 / hidden**0.5))
        add(f"blk.{i}.attn_output.weight", matrix(hidden, spec.num_heads * head_dim, 1.0 / hidden**0.5))
        add(f"blk.{i}.ffn_norm.weight", norm(hidden))
        add(f"blk.{i}.ffn_gate.weight", matrix(inter, hidden, 1.0 / hidden**0.5))
        add(f"blk.{i}.ffn_up.weight", matrix(inter, hidden, 1.0 / hidden**0.5))
        add(f"blk.{i}.ffn_down.weight", matrix(hidden, inter, 1.0 / inter**0.5))
    add("output_norm.weight", norm(hidden))
    if not spec.tie_embeddings:
        add("output.weight", matrix(vocab, hidden, 2.0 / hidden**0.5))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_dequantized_f32_copy(source: str | Path, path: str | Path, *, num_layers: int | None = None) -> Path:
    """Copy ``source`` to ``path`` with every tensor dequantised to F32 (metadata unchanged).

    llama.cpp computes F32 weights with F32 activations, so on the copy it is an exact oracle
    for the engine's arithmetic on the very weights of a quantised file (on the quantised file
    llama.cpp rounds activations to 8 bits first). Tensors keep llama.cpp's q/k row order.
    ``num_layers`` keeps only the first blocks (a draft model with the same vocabulary).
    """
    from core_engine.gguf_loader import GGUFFile

    src = GGUFFile(source)
    reader = gguf.GGUFReader(str(source))  # the typed fields, to write them back as they were
    writer = gguf.GGUFWriter(str(path), src.architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        if num_layers is not None and key == f"{src.architecture}.block_count":
            writer.add_block_count(num_layers)
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        name = tensor.name
        if num_layers is not None and name.startswith("blk.") and int(name.split(".")[1]) >= num_layers:
            continue
        writer.add_tensor(name, src.dequantized(name).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_first_layers_copy(source: str | Path, path: str | Path, num_layers: int) -> Path:
    """A draft model: ``source`` with only its first ``num_layers`` blocks (F32)."""
    return write_dequantized_f32_copy(source, path, num_layers=num_layers)


def write_with_vocab(
    model: str | Path,
    vocab: str | Path,
    path: str | Path,
    *,
    chat_template: str | None = None,
    embedding_type: GGMLQuantizationType = GGMLQuantizationType.F16,
    seed: int = 0,
) -> Path:
    """Copy the tiny model ``model`` to ``path`` with the vocabulary of the GGUF ``vocab``.

    Every ``tokenizer.*`` key of ``vocab`` (a real model's, e.g. llama.cpp's vocab-only
    ``ggml-vocab-*.gguf``) replaces the model's; ``chat_template`` (when given) becomes
    ``tokenizer.chat_template``. The token embedding and the output matrix get one random row
    per token of the new vocabulary (the scale of the old rows; stored as ``embedding_type``,
    F16 by default to halve a 150k-token file), ``{arch}.vocab_size`` follows; every other
    key and tensor is copied as it is. The model's weights are noise either way: this makes a
    file that carries a real vocabulary and template through a loader and a server.
    """
    from core_engine.tokenizer.gguf import read_gguf_metadata

    source = gguf.GGUFReader(str(model))
    arch = str(source.fields["general.architecture"].contents())
    # The engine's reader: gguf.GGUFReader takes seconds over a 250k-token vocabulary.
    words = {k: v for k, v in read_gguf_metadata(vocab).items() if k.startswith("tokenizer.")}
    if chat_template is not None:
        words["tokenizer.chat_template"] = chat_template
    n_vocab = len(words["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(str(path), arch)
    for key, field in source.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key in ("general.architecture", f"{arch}.vocab_size"):
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    writer.add_vocab_size(n_vocab)
    for key, value in words.items():
        writer.add_key_value(key, value, *_value_types(value))

    rng = np.random.default_rng(seed)
    for tensor in source.tensors:
        if tensor.tensor_type != GGMLQuantizationType.F32:
            raise ValueError(f"{model}: {tensor.name} is {tensor.tensor_type.name}; write_with_vocab copies F32 models")
        data = np.asarray(tensor.data, dtype=np.float32)
        if tensor.name in ("token_embd.weight", "output.weight"):
            rows = (rng.standard_normal((n_vocab, data.shape[1]), dtype=np.float32) * float(data.std()))
            encoded, raw_dtype = _encode_weight(rows, embedding_type)
            writer.add_tensor(tensor.name, encoded, raw_dtype=raw_dtype)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _value_types(value: Any) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """The GGUF types llama.cpp's converter writes a tokenizer value with (ids UINT32, token
    types INT32, scores FLOAT32)."""
    kinds = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32,
             str: gguf.GGUFValueType.STRING}
    if isinstance(value, list):
        item = type(value[0]) if value else str
        return gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32 if item is int else kinds[item]
    return kinds[type(value)], None
