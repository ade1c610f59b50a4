"""Continuing an answer another backend began (``GenerationRequest.resume``).

A native backend resumes by prefilling its prompt followed by the earlier output's token
ids (:func:`resumed_prompt`) and generating the rest. Its own detokenizer and stop-string
matcher start fresh at the break, so they would lose what straddles it: the bytes of a
character cut in two, a stop string whose start the failed backend held back. So the text
of a resumed answer is made again here from token ids over the WHOLE output (earlier ids,
then the new ones): :func:`resumed_output` decodes every piece with one incremental UTF-8
decoder, matches stop strings over the whole text with the backends' own matcher
(:class:`core_engine.stop_checker.StopChecker`), and streams only what the client has not
received yet.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Callable, Sequence

from backends.base import GenerationChunk, ResumeState, Usage
from core_engine.stop_checker import StopChecker

__all__ = ["resumed_output", "resumed_prompt"]


def resumed_prompt(
    prompt_ids: Sequence[int], resume: ResumeState, tokenize: Callable[[str], list[int]]
) -> list[int]:
    """The prompt of a resumed generation: the request's prompt, then the earlier output
    (its token ids, or the tokens of its text when the ids came from another vocabulary)."""
    tail = list(resume.token_ids) if resume.token_ids else tokenize(resume.text)
    return [*prompt_ids, *tail]


class _Continuation:
    """The whole output's text as the tokens come, and how much of it the client has."""

    def __init__(self, resume: ResumeState, piece: Callable[[int], bytes], stop: Sequence[str]) -> None:
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop: StopChecker[None] = StopChecker(stop)
        #: Characters the client has (from the earlier backend) still to come out of the matcher.
        self._skip = len(resume.text)
        if resume.token_ids:
            earlier = "".join(self._decoder.decode(piece(t)) for t in resume.token_ids)
        else:
            # The client's own part of the text is not output: no stop string is matched in it.
            earlier = resume.text[resume.num_given_chars :]
            self._skip = len(earlier)
        self._take(self._stop.push(earlier).text)

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output, once one has."""
        return self._stop.matched

    def add(self, token_id: int) -> str:
        """One new token: the text that may be sent now."""
        return self._take(self._stop.push(self._decoder.decode(self._piece(token_id))).text)

    def finish(self) -> str:
        """The output ended for another reason: the rest (an unfinished character: U+FFFD)."""
        text = self._stop.push(self._decoder.decode(b"", final=True)).text
        if self._stop.matched is None:
            text += self._stop.flush().text
        return self._take(text)

    def _take(self, released: str) -> str:
        """What the matcher released, less what the client already has."""
        skipped = min(self._skip, len(released))
        self._skip -= skipped
        return released[skipped:]


async def resumed_output(
    chunks: AsyncIterator[GenerationChunk],
    resume: ResumeState,
    *,
    piece: Callable[[int], bytes],
    stop: Sequence[str],
    num_prompt_tokens: int,
) -> AsyncIterator[GenerationChunk]:
    """Re-text the chunks of a resumed generation from their token ids (module docstring).

    Each chunk keeps its token ids and logprobs; its text is what the whole output releases
    with it. A stop string completed across the break ends the output there (the backend is
    closed, which aborts its work, and the usage is what it did: ``num_prompt_tokens``, the
    resumed prompt's length, and the tokens it generated); otherwise the usage of the last
    chunk is the backend's own.
    """
    output = _Continuation(resume, piece, stop)
    num_generated = 0
    try:
        async for chunk in chunks:
            text = ""
            ids: list[int] = []
            for token_id in chunk.token_ids:
                ids.append(token_id)
                text += output.add(token_id)
                if output.matched is not None:
                    break
            num_generated += len(ids)
            if output.matched is not None:
                logprobs = chunk.logprobs[: len(ids)] if chunk.logprobs is not None else None
                usage = chunk.usage
                if usage is None:  # cut before the backend's own end: what it did so far
                    usage = Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated)
                yield GenerationChunk(
                    text=text,
                    token_ids=tuple(ids),
                    logprobs=logprobs,
                    finish_reason="stop",
                    stop_sequence=output.matched,
                    usage=usage,
                    phases=chunk.phases,
                )
                return
            if chunk.finish_reason is not None:
                text += output.finish()
            if text or chunk.token_ids or chunk.finish_reason is not None or chunk.usage is not None:
                yield GenerationChunk(
                    text=text,
                    token_ids=chunk.token_ids,
                    logprobs=chunk.logprobs,
                    finish_reason=chunk.finish_reason,
                    # Matched by the final decode here, else by the backend in its new text.
                    stop_sequence=output.matched or chunk.stop_sequence,
                    usage=chunk.usage,
                    phases=chunk.phases,
                    speculation=chunk.speculation,
                )
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
