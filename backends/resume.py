"""Continuing an answer another backend began (``GenerationRequest.resume``).

A native backend resumes by prefilling its prompt followed by the earlier output's token
ids (:func:`resumed_prompt`) and generating the rest. Its own detokenizer and stop-string
matcher start fresh at the break, so they would lose what straddles it: the bytes of a
character cut in two, a stop string whose start the failed backend held back. So the text
of a resumed answer is made again here from token ids over the WHOLE output (earlier ids,
then the new ones): :func:`resumed_output` decodes every piece with one incremental UTF-8
decoder, matches stop strings over the whole text, holds back a possible stop-string start
as the backends do, and streams only what the client has not received yet.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Callable, Sequence

from backends.base import GenerationChunk, ResumeState, Usage

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
        self._stops = tuple(s for s in stop if s)
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if resume.token_ids:
            self.text = "".join(self._decoder.decode(piece(t)) for t in resume.token_ids)
        else:
            self.text = resume.text
        #: Characters of ``text`` the client has (from the earlier backend, then from here).
        self.num_released = len(resume.text)
        #: The stop string that ended the output, once one has.
        self.matched: str | None = None

    def add(self, token_id: int) -> str:
        """One new token: the text that may be sent now."""
        self.text += self._decoder.decode(self._piece(token_id))
        return self._release(final=False)

    def finish(self) -> str:
        """The output ended for another reason: the rest (an unfinished character: U+FFFD)."""
        self.text += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.matched is not None:
            return ""
        text = self.text
        best: tuple[int, str] | None = None
        for s in self._stops:
            # Only a match that ends past what was released can be new.
            idx = text.find(s, max(0, self.num_released - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            self.matched = best[1]
            end = max(best[0], self.num_released)
        else:
            end = len(text) if final else len(text) - self._held_back()
        out = text[self.num_released : end]
        self.num_released = max(self.num_released, end)
        return out

    def _held_back(self) -> int:
        text = self.text
        for n in range(min(self._max_hold, len(text) - self.num_released), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0


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
                    usage=chunk.usage,
                    phases=chunk.phases,
                    speculation=chunk.speculation,
                )
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
