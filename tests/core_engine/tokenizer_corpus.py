"""A varied text corpus for tokenizer equality tests (shared by the tokenizer tests)."""

from __future__ import annotations

__all__ = ["CORPUS"]

CORPUS: tuple[str, ...] = (
    "",
    " ",
    "Hello world!",
    "Hello, World! HELLO world hello WORLD",
    "I'm sure we've seen they'll do it; she'd said you're right. I'M SURE WE'VE SEEN THEY'LL",
    "don't won't can't shouldn't 'tis 'twas ''quoted'' 's 'S",
    # unicode letters, accents, combining marks
    "café naïve résumé façade coöperate Ångström São Paulo Zürich",
    "e\u0301 a\u0308 n\u0303 combining marks",
    "Привет, как дела? Ελληνικά γράμματα. עברית שלום. مرحبا بالعالم",
    # CJK
    "日本語のテキストです。東京は大きい都市です。",
    "中文文本测试：我们今天去公园散步吧！",
    "한국어 텍스트 테스트입니다. 안녕하세요",
    # emoji, ZWJ sequences, flags, skin tones, variation selectors
    "I love 🤖 and 🎉🎉🎉! 👩‍👩‍👧‍👦 family 🏳️‍🌈 flag 🇫🇷🇯🇵 thumbs 👍🏽 ❤️ ✔︎",
    "emoji at end 😀",
    # code
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
    "    if n <= 1:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    '{"name": "infermux", "version": [1, 2, 3], "nested": {"ok": true, "x": null}}',
    "<div class=\"main\"><p>Hello &amp; welcome</p></div>\n<script>let x = a && b || !c;</script>",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; } // dot product\n#include <stdio.h>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "$ ls -la | grep '^d' > out.txt 2>&1 && echo \"done\" ~/path/to/file.py",
    # whitespace runs, newlines, tabs, CRLF, unusual spaces
    "a  b   c    d     e",
    "line one\nline two\n\nline four\n\n\n\nline eight",
    "\n\n\n",
    "   leading and trailing   ",
    "\ttab\t\tdouble tab\t \t mixed",
    "windows\r\nline\r\nendings\r\n",
    "nbsp\u00a0here ideographic\u3000space en\u2002space line\u2028separator",
    "vertical\x0btab form\x0cfeed",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "      \n      \n\t\t\n",
    # digits and numbers
    "1234567890 12 345 6789 0.5 3.14159 1e-10 -42 +7 1,000,000",
    "Phone: +1 (555) 123-4567, year 2024, version 3.11.9",
    "Arabic-Indic ٠١٢٣٤٥٦٧٨٩ full-width １２３ superscript x² y³ fractions ½ ¾ roman Ⅻ",
    # punctuation
    "Wait... what?! (really) [yes] {no} <maybe> -- em—dash – en–dash «quotes» “curly” ‘single’",
    "!!!???... ### $$$ %%% ^^^ &&& *** ___ +++ === ||| ~~~ ``` @@@",
    # special tokens inside text (ids when parse_special, plain text otherwise)
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "text<|im_end|>more text<|endoftext|><|endoftext|>tail",
    "partial <|im_start and <|im_end| and |>",
    "<|im_start|><|im_start|>  <|im_end|>\n\n<|im_end|>",
    # mixed long paragraph
    "The quick brown fox (🦊) jumped over 13 lazy dogs 🐕🐕 in 2.5 seconds — 日本語 too!\n"
    "    Indented code: x = [i**2 for i in range(10)]  # squares\n\n\tDone.",
)
