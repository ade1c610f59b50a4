"""A GGUF model loaded through llama.cpp's C API: its vocabulary, metadata and prompts.

The model (weights, vocabulary) is read-only once loaded; the contexts that run it live in
:mod:`backends._llamacpp_loop`. Loading goes through :func:`~backends._llamacpp_safety.
apply_cpu_safety`, so a llama.cpp built with AMX kernels does not crash on its first decode.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import llama_cpp

from backends._llamacpp_safety import apply_cpu_safety
from backends.base import GenerationRequest, ResumeState
from backends.chat_plan import ChatOptions, load_chat
from backends.errors import InvalidRequestError
from backends.resume import resumed_prompt
from core_engine.chat.budget import ThinkingBudget, ThinkingParams
from core_engine.chat.content_text import ControlTexts
from core_engine.chat.formats import SPECIAL_MARKERS

__all__ = ["LlamaModel"]

#: Bytes per K or V element of llama.cpp's default cache type (f16).
_KV_ELEMENT_BYTES = 2


class LlamaModel:
    """Weights and vocabulary of one GGUF file; tokenizes and detokenizes for the runner.

    Raises ``RuntimeError`` when llama.cpp cannot load the file.
    """

    def __init__(self, path: Path, *, use_mmap: bool, chat: ChatOptions | None = None) -> None:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        params.load_mode = (
            llama_cpp.LLAMA_LOAD_MODE_MMAP if use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE
        )
        apply_cpu_safety(params)
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file failed for {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.metadata = _read_metadata(self.model)
        # End-of-generation tokens (eos, eot, <|endoftext|>...): scanning once is ~40 ms.
        self.eog_ids = frozenset(
            i for i in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, i)
        )
        self.add_bos = self.metadata.get("tokenizer.ggml.add_bos_token", "true") == "true"
        self.bos_id: int = llama_cpp.llama_vocab_bos(self.vocab)
        self._pieces: dict[int, bytes] = {}
        self._bos_text = self._special_text(self.metadata.get("tokenizer.ggml.bos_token_id"))
        eos_text = self._special_text(self.metadata.get("tokenizer.ggml.eos_token_id"))
        self.template_source = self.metadata.get("tokenizer.chat_template")
        self.template, self.chat_format = load_chat(
            chat, self.template_source, bos_token=self._bos_text, eos_token=eos_text,
            control_texts=ControlTexts(self._control_texts()),
        )

    def close(self) -> None:
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token position takes in every layer (f16 K and V)."""
        n_head = max(1, llama_cpp.llama_model_n_head(self.model))
        head_dim = llama_cpp.llama_model_n_embd(self.model) // n_head
        n_head_kv = llama_cpp.llama_model_n_head_kv(self.model)
        n_layer = llama_cpp.llama_model_n_layer(self.model)
        return 2 * n_layer * n_head_kv * head_dim * _KV_ELEMENT_BYTES

    # -- prompt ---------------------------------------------------------------------------

    def prompt_tokens(self, request: GenerationRequest, chat_text: str | None = None) -> tuple[list[int], str]:
        """Token ids and text of the request's prompt (``chat_text``: the rendered chat)."""
        if request.kind == "chat":
            assert chat_text is not None, "chats are rendered by backends.chat_plan"
            control = self.template.control_texts
            add_bos = self.add_bos and not (self._bos_text and chat_text.startswith(self._bos_text))
            tokens = control.encode(
                chat_text,
                lambda piece, add_special, parse_special: self.tokenize(
                    piece, add_bos=add_special, parse_special=parse_special
                ),
                add_special=add_bos,
            )
            return tokens, control.text(chat_text)
        prompt = request.prompt
        if isinstance(prompt, tuple):
            bad = next((t for t in prompt if not 0 <= t < self.n_vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"token id {bad} is outside the vocabulary (0..{self.n_vocab - 1})",
                    param="prompt",
                )
            tokens = list(prompt)
            return tokens, self.detokenize(tokens).decode("utf-8", errors="replace")
        # A raw prompt is the client's whole prompt: its special-token texts are parsed, as
        # llama.cpp's server does; chat content never is (above).
        text = prompt or ""
        return self.tokenize(text, add_bos=self.add_bos), text

    def resumed_prompt(self, tokens: list[int], resume: ResumeState) -> list[int]:
        """The prompt followed by the earlier backend's output (backends/resume.py); its text,
        when it comes without ids, is text: control-token texts in it are not parsed."""
        return resumed_prompt(tokens, resume, lambda text: self.tokenize(text, add_bos=False, parse_special=False))

    # -- vocabulary -----------------------------------------------------------------------

    def tokenize(self, text: str, *, add_bos: bool, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are parsed as such unless
        ``parse_special`` is off (``add_bos``: llama.cpp's ``add_special``)."""
        data = text.encode("utf-8")
        capacity = len(data) + 2  # a token covers at least one byte, plus BOS
        buffer = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buffer, capacity, add_bos, parse_special)
        if n < 0:  # cannot happen with the bound above; kept for odd vocabularies
            capacity = -n
            buffer = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), buffer, capacity, add_bos, parse_special
            )
        return list(buffer[:n])

    def _control_texts(self) -> list[str]:
        """The texts llama.cpp turns into tokens only with ``parse_special`` (control and
        unknown tokens); user-defined tokens match in any text."""
        special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        return [
            (llama_cpp.llama_vocab_get_text(self.vocab, i) or b"").decode("utf-8", errors="replace")
            for i in range(self.n_vocab)
            if llama_cpp.llama_vocab_get_attr(self.vocab, i) & special
        ]

    def piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens render as nothing, except the tool-call and
        reasoning markers of :data:`~core_engine.chat.formats.SPECIAL_MARKERS` that do not end
        generation: the output parsers need them), cached per id."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._token_to_piece(token, special=False)
            if not piece and token not in self.eog_ids:
                text = self._token_to_piece(token, special=True)
                if text.decode("utf-8", errors="replace") in SPECIAL_MARKERS:
                    piece = text
            self._pieces[token] = piece
        return piece

    def thinking_budget(self, params: ThinkingParams) -> ThinkingBudget:
        """A request's thinking budget over this vocabulary (markers matched on bytes)."""
        end_ids = self.tokenize(params.end, add_bos=False)
        return ThinkingBudget(params, end_ids, lambda t: self._token_to_piece(t, special=True))

    def detokenize(self, tokens: list[int]) -> bytes:
        """The bytes of ``tokens`` (llama-cpp-python's rule: no leading space after BOS)."""
        data = b"".join(self.piece(t) for t in tokens)
        if tokens and tokens[0] == self.bos_id and data.startswith(b" "):
            return data[1:]
        return data

    def token_text(self, token: int) -> bytes:
        """The bytes of one token as written in text, special tokens included (detokenize)."""
        return self._token_to_piece(token, special=True)

    def _special_text(self, token_id: str | None) -> str:
        if token_id is None:
            return ""
        return self._token_to_piece(int(token_id), special=True).decode("utf-8", errors="replace")

    def _token_to_piece(self, token: int, *, special: bool) -> bytes:
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buffer, size, 0, special)
            if n >= 0:
                return buffer.raw[:n]
            size = -n


def _read_metadata(model: Any) -> dict[str, str]:
    """The GGUF key/value metadata as strings (arrays are summarised by llama.cpp)."""
    metadata: dict[str, str] = {}
    size = 1024
    buffer = ctypes.create_string_buffer(size)

    def read(getter: object, index: int) -> str:
        nonlocal buffer, size
        n = getter(model, index, buffer, size)  # type: ignore[operator]
        if n >= size:
            size = n + 1
            buffer = ctypes.create_string_buffer(size)
            n = getter(model, index, buffer, size)  # type: ignore[operator]
        return buffer.value.decode("utf-8", errors="replace")

    for index in range(llama_cpp.llama_model_meta_count(model)):
        key = read(llama_cpp.llama_model_meta_key_by_index, index)
        metadata[key] = read(llama_cpp.llama_model_meta_val_str_by_index, index)
    return metadata
