"""The ``disaggregated`` backend: each request prefilled by one core engine, decoded by another.

Options name two ``core_engine`` backends of the same config: ``prefill`` (``role =
"prefill"``) and ``decode`` (``role = "decode"``), with the same ``kv_transfer`` transport.
A request goes to the prefill backend labelled with a fresh transfer id
(:data:`~backends.core_engine.KV_PREFILL_LABEL`); that engine computes the prompt's KV and the
first token and sends the KV under the id. The request then goes to the decode backend
labelled with the same id (:data:`~backends.core_engine.KV_DECODE_LABEL`), which receives the
KV, reuses the prompt blocks its prefix cache already holds, and streams the whole output
(first token included). Nothing of the KV passes through this backend.

Failures before the decode streams its first chunk lose nothing: a prefill that fails or a
transfer that never arrives whole is tried again with a new id, up to ``max_attempts`` times;
after that, or at once when the prefill backend is not healthy after a failure (its worker
was killed mid-transfer and is restarting), the decode engine serves the request whole
(``fallback_to_decode``): waiting for a restarting worker would cost the request tens of
seconds. Once output has been streamed, an error is the client's, as with
any backend. Logprobs and echo are not offered: the first token is sampled where its
logprobs are not kept.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Mapping

import msgspec

from backends._option import decode_options
from backends.base import (
    Backend,
    BackendConfig,
    Capabilities,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    ModelInfo,
)
from backends.core_engine import KV_DECODE_LABEL, KV_PREFILL_LABEL
from backends.errors import BackendError, BackendUnavailableError, InfermuxError

__all__ = ["DisaggregatedBackend", "DisaggregatedOptions", "create_backend"]

logger = logging.getLogger(__name__)


class DisaggregatedOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a ``kind = "disaggregated"`` backend."""

    #: The ``[[backends]]`` names of the prefill and the decode core engines.
    prefill: str
    decode: str
    #: Prefill + transfer attempts per request before the fallback.
    max_attempts: int = 3
    #: Pause before an attempt after a failed one (a restarting worker comes back meanwhile);
    #: doubles each time.
    retry_backoff_s: float = 0.5
    #: After ``max_attempts`` failures, let the decode engine prefill the request itself.
    fallback_to_decode: bool = True


class DisaggregatedBackend:
    """Routes each request prefill → decode; see the module docstring."""

    kind = "disaggregated"

    def __init__(self, config: BackendConfig) -> None:
        self.name = config.name
        self.config = config
        self.options = decode_options(config, DisaggregatedOptions)
        o = self.options
        prefix = f"backends.{self.name}.options."
        if o.prefill == o.decode:
            raise ValueError(f"{prefix}decode: must name another backend than prefill ({o.prefill!r})")
        if self.name in (o.prefill, o.decode):
            raise ValueError(f"{prefix}prefill/decode: a disaggregated backend cannot name itself")
        if o.max_attempts < 1:
            raise ValueError(f"{prefix}max_attempts: must be at least 1, got {o.max_attempts}")
        if o.retry_backoff_s < 0:
            raise ValueError(f"{prefix}retry_backoff_s: must be >= 0, got {o.retry_backoff_s}")
        self.capabilities = Capabilities(logprobs=False, echo=False, structured_outputs=False)
        self._prefill: Backend | None = None
        self._decode: Backend | None = None
        #: Counters (tests, /metrics): requests served through the pair, attempts that failed
        #: and were retried, requests the decode engine served whole after them.
        self.num_disaggregated = 0
        self.num_retries = 0
        self.num_fallbacks = 0

    def bind_backends(self, backends: Mapping[str, Backend]) -> None:
        """Take the prefill and decode backends from the gateway's built backends."""
        prefix = f"backends.{self.name}.options."
        for key in ("prefill", "decode"):
            name = getattr(self.options, key)
            if name not in backends:
                raise ValueError(f"{prefix}{key}: no [[backends]] entry is named {name!r}")
            if backends[name].kind != "core_engine":
                raise ValueError(f"{prefix}{key}: {name!r} is a {backends[name].kind!r} backend, not core_engine")
        self._prefill = backends[self.options.prefill]
        self._decode = backends[self.options.decode]

    def _pair(self) -> tuple[Backend, Backend]:
        if self._prefill is None or self._decode is None:
            raise BackendUnavailableError(f"backend {self.name!r}: its prefill and decode backends are not bound")
        return self._prefill, self._decode

    # -- lifecycle (the pair's own lives are the gateway's) ----------------------------------

    async def start(self) -> None:
        self._pair()

    async def aclose(self) -> None:
        pass

    def model_info(self) -> ModelInfo:
        _, decode = self._pair()
        return decode.model_info()

    async def health(self) -> HealthStatus:
        prefill, decode = self._pair()
        states = [await prefill.health(), await decode.health()]
        ok = all(s.ok for s in states)
        return HealthStatus(ok=ok, detail=f"prefill: {states[0].detail}; decode: {states[1].detail}")

    def stats(self) -> dict[str, float]:
        return {
            "disaggregated_requests": float(self.num_disaggregated),
            "disaggregated_retries": float(self.num_retries),
            "disaggregated_fallbacks": float(self.num_fallbacks),
        }

    # -- serving ------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        prefill, decode = self._pair()
        o = self.options
        backoff = o.retry_backoff_s
        last_error: InfermuxError | None = None
        for attempt in range(o.max_attempts):
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(backoff)
                backoff *= 2
            transfer_id = f"{request.request_id}.{request.choice_index}.{attempt}.{uuid.uuid4().hex[:12]}"
            try:
                await self._run_prefill(prefill, request, transfer_id)
            except BackendError as exc:
                if not exc.retryable and not isinstance(exc, BackendUnavailableError):
                    raise
                logger.warning("backend %s: prefill attempt %d failed: %s", self.name, attempt + 1, exc.message)
                last_error = exc
                if not (await prefill.health()).ok:
                    break  # its worker is restarting: the decode engine serves this one now
                continue
            labels = {**request.labels, KV_DECODE_LABEL: transfer_id}
            stream = decode.generate(msgspec.structs.replace(request, labels=labels))
            streamed = False
            try:
                async for chunk in stream:
                    streamed = True
                    yield chunk
            except BackendUnavailableError as exc:
                if streamed:
                    raise
                logger.warning("backend %s: decode of attempt %d failed: %s", self.name, attempt + 1, exc.message)
                last_error = exc
                continue
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
            self.num_disaggregated += 1
            return
        if not o.fallback_to_decode:
            assert last_error is not None
            raise last_error
        self.num_fallbacks += 1
        logger.warning("backend %s: the prefill failed (%s); the decode engine serves the request whole",
                       self.name, last_error.message if last_error is not None else "")
        stream = decode.generate(request)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _run_prefill(self, prefill: Backend, request: GenerationRequest, transfer_id: str) -> None:
        """Prefill ``request`` on ``prefill`` and have its KV sent under ``transfer_id``."""
        labels = {**request.labels, KV_PREFILL_LABEL: transfer_id}
        stream = prefill.generate(msgspec.structs.replace(request, labels=labels, stream=False))
        try:
            async for _ in stream:  # one chunk: the first token (the decode streams it again)
                pass
        finally:
            await stream.aclose()  # type: ignore[attr-defined]


def create_backend(config: BackendConfig) -> DisaggregatedBackend:
    """Factory registered for kind ``"disaggregated"``."""
    return DisaggregatedBackend(config)
