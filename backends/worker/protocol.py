"""The messages between the gateway and a backend's worker process (msgpack over ZeroMQ).

Every frame is a list of messages, so that the tokens of many sequences produced in one
loop turn cross in one send. Errors cross as :class:`WireError` and are raised again on the
gateway side as the same class of :mod:`backends.errors`.

Policies are objects and do not cross. A backend that consults engine policies gets them
in the worker, built there from a :class:`PolicySource` carried by :class:`Start`: the
import path of a factory and the plugin selection it is called with (the gateway's
``[plugins]`` table), so the plugins answering the engine hooks are loaded in the engine's
own process from the same entry points, config modules and settings (see
:mod:`backends.worker.child`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from backends import errors
from backends.base import BackendConfig, Capabilities, GenerationChunk, GenerationRequest, ModelInfo
from backends.prefix_cache import CacheEvents

__all__ = [
    "Cancel",
    "Chunks",
    "Failed",
    "Finished",
    "Generate",
    "KVEvents",
    "Message",
    "PolicySource",
    "Start",
    "StartFailed",
    "Started",
    "Stats",
    "Stop",
    "WireError",
    "decode_frame",
    "encode_frame",
    "from_wire",
    "to_wire",
]


class WireError(msgspec.Struct, frozen=True, kw_only=True):
    """An :class:`~backends.errors.InfermuxError` as data: its class name and fields."""

    kind: str
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None


# -- gateway -> worker ------------------------------------------------------------------------


class PolicySource(msgspec.Struct, frozen=True, kw_only=True):
    """How the worker builds the policies its backend consults: ``factory(plugins)``.

    ``factory`` is ``module:attribute`` (the gateway passes ``plugins.policy:worker_policies``);
    ``plugins`` the plugin selection as plain data (the ``[plugins]`` table).
    """

    factory: str
    plugins: dict[str, Any] = {}


class Start(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Build the backend with ``factory`` (``module:attribute``), give it the policies
    ``policies`` makes (when it takes policies), and start it."""

    config: BackendConfig
    factory: str
    policies: PolicySource | None = None


class Generate(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    id: int
    request: GenerationRequest


class Cancel(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    id: int


class Stop(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Close the backend and exit."""


# -- worker -> gateway ------------------------------------------------------------------------


class Started(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    pid: int
    capabilities: Capabilities
    model_info: ModelInfo


class StartFailed(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    error: WireError


class Chunks(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    id: int
    chunks: list[GenerationChunk]


class Finished(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    id: int


class Failed(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    id: int
    error: WireError


class Stats(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The backend's ``stats()`` and counters (sent when they change, at most every 100 ms)."""

    values: dict[str, float]


class KVEvents(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Prefix-cache changes of the worker's engine (before each ``Finished``, and with the
    stats when evictions happened meanwhile); bounded by the engine's log."""

    events: CacheEvents


Message = (
    Start | Generate | Cancel | Stop | Started | StartFailed | Chunks | Finished | Failed | Stats | KVEvents
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Message])


def encode_frame(messages: list[Any]) -> bytes:
    return _encoder.encode(messages)


def decode_frame(frame: bytes) -> list[Message]:
    return _decoder.decode(frame)


def to_wire(exc: errors.InfermuxError) -> WireError:
    return WireError(
        kind=type(exc).__name__,
        message=exc.message,
        param=exc.param,
        code=exc.code,
        retry_after=exc.retry_after,
    )


def from_wire(wire: WireError) -> errors.InfermuxError:
    """The error again, as its own class when :mod:`backends.errors` has it."""
    cls = getattr(errors, wire.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.InfermuxError)):
        cls = errors.BackendError
    return cls(wire.message, param=wire.param, code=wire.code, retry_after=wire.retry_after)
