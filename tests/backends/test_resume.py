"""``backends.resume``: a resumed answer's text made again over the whole output.

The pieces are a byte-level vocabulary written out here (a stand-in for a tokenizer: the
rule under test is the UTF-8 and stop-string handling across the break, not tokenizing).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from backends.base import GenerationChunk, ResumeState, Usage
from backends.resume import resumed_output, resumed_prompt

#: id -> bytes; "é" is cut in two tokens (0xC3, 0xA9), as byte-level vocabularies do.
PIECES = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b" au", 5: b" lait", 6: b" !", 7: b" l", 8: b"'av"}


async def _chunks(ids: list[int], *, finish: bool = True) -> AsyncIterator[GenerationChunk]:
    for i, token_id in enumerate(ids):
        last = finish and i == len(ids) - 1
        yield GenerationChunk(
            text="(the backend's own text, ignored)",
            token_ids=(token_id,),
            finish_reason="length" if last else None,
            usage=Usage(prompt_tokens=9, completion_tokens=len(ids)) if last else None,
        )


def _run(resume: ResumeState, new_ids: list[int], stop: tuple[str, ...] = ()) -> list[GenerationChunk]:
    async def collect() -> list[GenerationChunk]:
        stream = resumed_output(
            _chunks(new_ids), resume, piece=PIECES.__getitem__, stop=stop, num_prompt_tokens=7
        )
        return [chunk async for chunk in stream]

    return asyncio.run(collect())


def test_a_character_cut_by_the_break_is_completed_not_replaced() -> None:
    # The failed backend sent "caf" and the first byte of "é" (no text for it yet).
    chunks = _run(ResumeState(token_ids=(1, 2), text="caf"), [3, 4, 5])
    assert "".join(c.text for c in chunks) == "é au lait"
    assert [c.token_ids for c in chunks] == [(3,), (4,), (5,)]
    assert chunks[-1].usage == Usage(prompt_tokens=9, completion_tokens=3)


def test_a_stop_string_straddling_the_break_ends_the_answer_there() -> None:
    # " au" was held back as the start of the stop " au lait".
    chunks = _run(ResumeState(token_ids=(1, 2, 3, 4), text="café"), [5, 6], stop=(" au lait",))
    assert "".join(c.text for c in chunks) == ""
    assert chunks[-1].finish_reason == "stop"
    # Cut before the backend's own end: the usage is what it did so far.
    assert chunks[-1].usage == Usage(prompt_tokens=7, completion_tokens=1)


def test_held_text_that_turns_out_not_to_stop_is_released_once() -> None:
    chunks = _run(ResumeState(token_ids=(1, 2, 3, 7), text="café"), [8, 6], stop=(" l'avenir",))
    assert "".join(c.text for c in chunks) == " l'av !"
    assert chunks[-1].finish_reason == "length"


def test_without_token_ids_the_text_is_the_start_of_the_continuation() -> None:
    chunks = _run(ResumeState(text="café au"), [5], stop=("au lait",))
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == ""
    assert resumed_prompt([100, 101], ResumeState(text="café"), lambda text: [len(text)]) == [100, 101, 4]
    assert resumed_prompt([100], ResumeState(token_ids=(1, 2), text="caf"), lambda text: []) == [100, 1, 2]


def test_stop_strings_are_not_matched_in_the_text_the_client_wrote() -> None:
    # continue_final_message: "café au" is the client's; only the output is matched, as vLLM does.
    given = ResumeState(text="café au", num_given_chars=7)
    chunks = _run(given, [5, 6], stop=("au lait", " !"))
    assert "".join(c.text for c in chunks) == " lait"
    assert chunks[-1].finish_reason == "stop"
    # After a failover the text streamed since is matched (here " lait" was streamed).
    resumed = ResumeState(text="café au lait", num_given_chars=7)
    chunks = _run(resumed, [6], stop=("lait !",))
    assert "".join(c.text for c in chunks) == ""
    assert chunks[-1].finish_reason == "stop"
