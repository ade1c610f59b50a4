"""Pre-tokenizers: split text into words before byte-level BPE, exactly as llama.cpp does.

A GGUF names its pre-tokenizer in ``tokenizer.ggml.pre``. llama.cpp maps that name to a type and
each type to an ordered list of regexes. The regexes are applied in turn: every match of a regex
inside a current chunk becomes a chunk, and so does the text between matches (nothing is
dropped), so later regexes refine the split of earlier ones. Two regexes (GPT-2's and Llama 3's)
run as hand-written scanners in llama.cpp that behave as if ``|\\s+`` ended the pattern; the
table below spells that fallback out. ``\\s`` is Unicode White_Space in both the ``regex``
module and llama.cpp's tables.
"""

from __future__ import annotations

import regex

__all__ = ["PRE_TOKENIZER_TYPES", "SPM_STYLE_PRE_TOKENIZER", "PreTokenizer", "UnsupportedPreTokenizerError", "pre_tokenizer_type"]


class UnsupportedPreTokenizerError(ValueError):
    """``tokenizer.ggml.pre`` names a pre-tokenizer this engine does not implement."""


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (  # Qwen2's with combining marks (\p{M}) kept in words
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM's letters and punctuation: literal code-point ranges in llama.cpp's table.
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-"
    "\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-"
    "\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-"
    "\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e"
    "\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-"
    "\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-"
    "\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CHATGLM4 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

#: The pre-tokenizer type of SentencePiece-style BPE (raw UTF-8, "▁" spaces, "<0xXX>" bytes).
SPM_STYLE_PRE_TOKENIZER = "gemma4"

#: Regex lists per pre-tokenizer type (llama.cpp's ``llm_tokenizer_bpe`` table).
PRE_TOKENIZER_TYPES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),  # also starcoder, refact, command-r, codeshell, exaone, minerva
    "llama3": (_LLAMA3,),  # also dbrx, smaug
    "qwen2": (_QWEN2,),  # also stablelm2, hunyuan, grok-2
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    "deepseek-llm": (
        r"[\r\n]", rf"\s?[{_DEEPSEEK_LLM_LETTERS}]+", "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+\Z",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}+",
    ),
    "qwen35": (_QWEN35,),
    # SentencePiece-style BPE on raw UTF-8 (spaces already "▁"): only newline runs are cut off.
    "gemma4": (r"[^\n]+|[\n]+",),
    "poro": (r" ?[^(\s|.,!?…。，、।۔،)]+",),
    "viking": (r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"),
    "chatglm4": (_CHATGLM4,),
    "tekken": (_TEKKEN,),
    "gpt-4o": (_GPT4O,),
    "seed-coder": (_SEED_CODER,),
    "bailingmoe": (_BAILINGMOE,),
}

# tokenizer.ggml.pre value → (type, ignore_merges, add_bos default).
_PRE_NAMES: dict[str, tuple[str, bool, bool]] = {"default": ("default", False, False)}
for _names, _entry in (
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     ("llama3", True, True)),
    (("dbrx", "smaug-bpe"), ("llama3", False, False)),
    (("falcon",), ("falcon", False, False)),
    (("mpt", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
      "a.x-4.0", "mellum", "olmo", "jais", "exaone4", "trillion", "granite-docling", "jina-v1-en",
      "jina-v2-code", "roberta-bpe"), ("gpt2", False, False)),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
     ("smollm", False, False)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan", "grok-2"),
     ("qwen2", False, False)),
    (("deepseek-coder",), ("deepseek-coder", False, False)),
    (("deepseek-llm",), ("deepseek-llm", False, False)),
    (("qwen35",), ("qwen35", False, False)),
    (("gemma4", "granite-embed-multi-311m"), ("gemma4", False, True)),
    (("poro-chat", "bloom", "gpt3-finnish"), ("poro", False, False)),
    (("viking",), ("viking", False, False)),
    (("glm4", "chatglm-bpe"), ("chatglm4", False, False)),
    (("tekken",), ("tekken", True, True)),
    (("gpt-4o", "llama4", "minimax-m2"), ("gpt-4o", False, False)),
    (("seed-coder",), ("seed-coder", False, False)),
    (("bailingmoe", "bailingmoe2", "llada-moe"), ("bailingmoe", False, False)),
):
    for _name in _names:
        _PRE_NAMES[_name] = _entry


def pre_tokenizer_type(name: str | None) -> tuple[str, bool, bool]:
    """``tokenizer.ggml.pre`` → (type, ignore_merges, default add_bos), as llama.cpp decides.

    A missing name falls back to ``default`` like llama.cpp; a name llama.cpp knows but this
    table lacks raises :class:`UnsupportedPreTokenizerError` rather than tokenizing differently.
    """
    if name is None:
        return _PRE_NAMES["default"]
    try:
        return _PRE_NAMES[name]
    except KeyError:
        raise UnsupportedPreTokenizerError(
            f"tokenizer.ggml.pre = {name!r} is not supported "
            f"(supported: {', '.join(sorted(_PRE_NAMES))})"
        ) from None


class PreTokenizer:
    """Splits text into the words BPE runs on, for one pre-tokenizer type."""

    def __init__(self, kind: str) -> None:
        if kind not in PRE_TOKENIZER_TYPES:
            raise UnsupportedPreTokenizerError(f"unknown pre-tokenizer type {kind!r}")
        self.kind = kind
        self._patterns = [regex.compile(p) for p in PRE_TOKENIZER_TYPES[kind]]

    def split(self, text: str) -> list[str]:
        """Words of ``text`` in order; their concatenation is ``text``."""
        chunks = [text]
        for pattern in self._patterns:
            refined: list[str] = []
            for chunk in chunks:
                pos = 0
                for match in pattern.finditer(chunk):
                    start, end = match.span()
                    if start > pos:
                        refined.append(chunk[pos:start])  # text between matches stays a chunk
                    if end > start:
                        refined.append(chunk[start:end])
                    pos = max(pos, end)
                if pos < len(chunk):
                    refined.append(chunk[pos:])
            chunks = refined
        return chunks
