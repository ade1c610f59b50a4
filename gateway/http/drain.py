"""Graceful drain on SIGTERM / SIGINT: the uvicorn server ``infermux serve`` runs.

On the first signal the gateway keeps listening but turns away new work:

1. ``/ready`` answers 503 ``draining`` (load balancers stop sending) and new generation
   requests get 503 ``server_is_overloaded`` with ``Retry-After``;
2. generation requests already admitted (running or queued) go on until they finish, for
   at most ``[server] drain_timeout_s``;
3. whatever still runs then is cancelled (upstream work aborted, usage reported), with
   ``[plugins] hook_timeout_s`` + 1 s for that clean-up;
4. uvicorn closes the listening socket and the connections, the backends are closed, and
   the process exits 0.

A second signal skips the rest of the drain and shuts down at once.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from gateway.state import GatewayState

__all__ = ["DrainingServer"]

logger = logging.getLogger("gateway")


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` with the drain above (see the module docstring)."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        gateway: GatewayState,
        drain_timeout_s: float,
        cleanup_timeout_s: float,
    ) -> None:
        super().__init__(config)
        self._gateway = gateway
        self.drain_timeout_s = drain_timeout_s
        self.cleanup_timeout_s = cleanup_timeout_s
        self._drain_started: float | None = None
        self._cancelled_at: float | None = None
        #: Non-zero when the gateway stopped because it cannot start as configured.
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_started is None and not self.should_exit:
            self._drain_started = time.monotonic()
            self._gateway.draining = True
            logger.info(
                "%s: draining; %d generation request(s) in flight get up to %g s "
                "(signal again to stop at once)",
                signal.Signals(sig).name,
                self._gateway.admission.num_in_flight,
                self.drain_timeout_s,
            )
            return
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutdown (exit 128+sig); a drained
        # shutdown is a clean one.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    async def on_tick(self, counter: int) -> bool:
        if self._gateway.startup_error is not None and not self.should_exit:
            # A backend cannot start as configured (logged by the loader): exit non-zero.
            self.exit_code = 2
            self.should_exit = True
        if self._drain_started is not None and not self.should_exit:
            self._advance_drain()
        return await super().on_tick(counter)

    def _advance_drain(self) -> None:
        assert self._drain_started is not None
        now = time.monotonic()
        in_flight = self._gateway.admission.num_in_flight
        if self._cancelled_at is None:
            if in_flight == 0:
                logger.info("drained in %.1f s; shutting down", now - self._drain_started)
                self.should_exit = True
            elif now - self._drain_started >= self.drain_timeout_s:
                tasks = list(self.server_state.tasks)
                logger.warning(
                    "drain window of %g s is over: cancelling %d request(s) still running",
                    self.drain_timeout_s,
                    in_flight,
                )
                for task in tasks:
                    task.cancel(msg="the drain window is over")
                self._cancelled_at = now
            return
        if not self.server_state.tasks or now - self._cancelled_at >= self.cleanup_timeout_s:
            self.should_exit = True
