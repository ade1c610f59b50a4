"""What rank 0 and the other ranks of a tensor-parallel engine say to each other over their
control sockets (msgspec frames; the activations go through the process group instead)."""

from __future__ import annotations

import msgspec

from core_engine.config import EngineConfig
from core_engine.model_runner import ForwardBatch

__all__ = ["Loaded", "Message", "RankInit", "Ready", "StartRunner", "Step", "Stop", "decoder", "encoder"]


class RankInit(msgspec.Struct, frozen=True, tag="init"):
    """Join the group and load the model (the config as rank 0's policies resolved it)."""

    config: EngineConfig
    rank: int
    world_size: int
    port: int
    device: str
    num_threads: int | None


class Loaded(msgspec.Struct, frozen=True, tag="loaded"):
    """A rank holds its shard of the weights."""

    rank: int
    resident_bytes: int


class StartRunner(msgspec.Struct, frozen=True, tag="runner"):
    """Allocate the KV pool: rank 0's block count (every rank stores the same block ids)."""

    num_blocks: int


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    rank: int


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    pass


class Step(msgspec.Struct, frozen=True, tag="step"):
    batch: ForwardBatch


Message = RankInit | Loaded | StartRunner | Ready | Stop | Step

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Message)
