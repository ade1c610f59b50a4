"""One generation request from its admission to its last report: the one owner of its clean-up.

A request that was admitted and whose choices opened holds three things that must each end
exactly once, in this order, whatever way the request ends (answered, failed before or after
the first byte, the client gone, the server shutting down):

1. **stop**: the unfinished choices are aborted upstream, then the admission slot is freed and
   the key charged the tokens (:meth:`~gateway.serving.admission.Grant.release`; its own
   step: an abort that raises still gives the slot back);
2. **end**: ``on_request_end`` with the request's summary; the usage ledger has committed the
   record when it returns, so it runs *before* the response's final bytes;
3. **report**: ``on_response`` / ``on_error`` for every choice, after the response.

The steps sit on two :class:`contextlib.AsyncExitStack` s: :meth:`finish` unwinds the first
(stop, end) and :meth:`aclose` the second (the first if it is still wound, then report). An
exit stack pops each callback before running it, so no step can run twice and none is
skipped when an earlier one raises: "exactly once" holds by construction, not by flags.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

from gateway.serving.admission import Grant
from gateway.serving.choices import ChoiceRun

__all__ = ["RequestLife"]


class RequestLife:
    """The admitted, opened request: its :class:`ChoiceRun` and its admission :class:`Grant`."""

    def __init__(self, run: ChoiceRun, grant: Grant) -> None:
        self.run = run
        self.grant = grant
        self._before_final_bytes = AsyncExitStack()
        # Unwound last-in first-out: abort, release, end.
        self._before_final_bytes.push_async_callback(run.end_request)
        self._before_final_bytes.push_async_callback(self._release)
        self._before_final_bytes.push_async_callback(run.abort)
        self._to_the_end = AsyncExitStack()
        self._to_the_end.push_async_callback(run.report)
        self._to_the_end.push_async_callback(self._before_final_bytes.aclose)

    async def _release(self) -> None:
        """The slot back, and the key charged what the choices used (known once aborted)."""
        total = self.run.total_usage()
        await self.grant.release(total.prompt_tokens + total.completion_tokens)

    async def finish(self) -> None:
        """Before the response's final bytes: stop the upstream work, free the slot, end the
        request for the plugins (a no-op once done)."""
        await self._before_final_bytes.aclose()

    async def aclose(self) -> None:
        """Whatever of stop, end and report has not run yet (a no-op once done)."""
        await self._to_the_end.aclose()
