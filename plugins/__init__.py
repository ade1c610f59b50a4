"""infermux plugins: what a plugin author imports, in one place.

::

    from plugins import GenerationRequest, hookimpl

    @hookimpl
    def infermux_transform_request(request: GenerationRequest) -> GenerationRequest | None: ...

The hooks and their contracts are in :mod:`plugins.hookspecs` (``hookspec`` marks them,
``hookimpl`` marks an implementation); this module re-exports the markers and the types the
hooks receive and return, which live with the layer that owns them (:mod:`backends.base`,
:mod:`backends.errors`, :mod:`core_engine.policy`, :mod:`plugins.request_summary`,
:mod:`plugins.usage_report`). Importing it loads no built-in plugin and nothing of the
gateway. Test helpers that start a live gateway are in :mod:`plugins.testing`.

The config the ``infermux_startup`` hook receives is the gateway's own
:class:`gateway.config.types.InfermuxConfig`; plugins never import the gateway at run time, so
name it for type checkers only
(``if TYPE_CHECKING: from gateway.config.types import InfermuxConfig``).
"""

from backends.base import (
    Backend,
    BackendConfig,
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
    Usage,
)
from backends.errors import InfermuxError, InvalidRequestError, RateLimitError
from core_engine.policy import (
    KVOffloadContext,
    KVOffloadDecision,
    QuantizationContext,
    QuantizationDecision,
    SpeculationContext,
    SpeculationDecision,
)
from plugins.hookspecs import PROJECT_NAME, hookimpl, hookspec
from plugins.request_summary import (
    ChoiceOutcome,
    ChoiceSummary,
    RequestStatus,
    RequestSummary,
    http_request_id,
)
from plugins.usage_report import UsageQuery, UsageReport

__all__ = [
    "PROJECT_NAME",
    "Backend",
    "BackendConfig",
    "ChatMessage",
    "ChoiceOutcome",
    "ChoiceSummary",
    "GenerationChunk",
    "GenerationRequest",
    "InfermuxError",
    "InvalidRequestError",
    "KVOffloadContext",
    "KVOffloadDecision",
    "QuantizationContext",
    "QuantizationDecision",
    "RateLimitError",
    "RequestStatus",
    "RequestSummary",
    "SamplingParams",
    "SpeculationContext",
    "SpeculationDecision",
    "Usage",
    "UsageQuery",
    "UsageReport",
    "hookimpl",
    "hookspec",
    "http_request_id",
]
