"""The channels between processes are authenticated and bounded.

KV transfer over TCP (disaggregated prefill / decode): a non-loopback address without CURVE
keys is a config error; with keys, a plain-socket client speaking ZeroMQ's wire protocol (which
a keyless receiver takes a transfer from) and a ZeroMQ peer with an unknown key are refused,
and their transfer never reaches the decode engine, which keeps serving the disaggregated pair;
a transfer past ``max_message_bytes`` and transfers past ``max_pending_transfers`` are dropped.
The tensor-parallel rendezvous (TCP store and gloo) listens on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import torch
import zmq.auth

from backends.base import BackendConfig, ChatMessage, GenerationRequest, SamplingParams
from backends.core_engine import CoreEngineBackend
from backends.disaggregated import DisaggregatedBackend
from backends.errors import BackendConfigError
from core_engine.distributed.group import TensorParallelGroup, rendezvous_listener
from core_engine.kv_transfer import (
    KVTransferConfig,
    KVTransferError,
    KVTransferTimeout,
    PrefilledKV,
    open_receiver,
    open_sender,
)
from core_engine.kv_transfer.tcp import TcpKVReceiver
from tests.core_engine.test_kv_transfer import make_kv

_ENGINE = {"num_threads": 1, "kv_cache_memory_mb": 64, "engine_process": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


class Keys(msgspec.Struct, frozen=True):
    """CURVE certificates as an operator makes them with ``zmq.auth.create_certificates``."""

    decode_secret: str
    decode_public: str
    prefill_secret: str
    authorized: str  # a directory with the prefill engine's public certificate only


def make_keys(root: Path) -> Keys:
    made = {name: zmq.auth.create_certificates(str(root), name) for name in ("decode", "prefill")}
    authorized = root / "authorized"
    authorized.mkdir()
    shutil.copy(made["prefill"][0], authorized)
    return Keys(
        decode_secret=made["decode"][1], decode_public=made["decode"][0], prefill_secret=made["prefill"][1],
        authorized=str(authorized),
    )


def decode_side(keys: Keys, address: str, **options: Any) -> dict[str, Any]:
    return {"transport": "tcp", "address": address, "secret_key_file": keys.decode_secret,
            "authorized_keys_dir": keys.authorized} | options  # fmt: skip


def prefill_side(keys: Keys, address: str, secret: str | None = None, **options: Any) -> dict[str, Any]:
    return {"transport": "tcp", "address": address, "secret_key_file": secret or keys.prefill_secret,
            "server_key_file": keys.decode_public} | options  # fmt: skip


def transfer_frame(transfer_id: str, kv: PrefilledKV) -> bytes:
    """A transfer as the tcp transport puts it on the wire (what an attacker would write)."""
    name, meta = transfer_id.encode(), msgspec.msgpack.encode(kv.meta)
    return struct.pack("!4sII", b"IKV1", len(name), len(meta)) + name + meta + b"".join(bytes(b) for b in kv.buffers())


def raw_zmtp_push(port: int, frame: bytes, *, wait_s: float = 5.0) -> bool:
    """Send ``frame`` from a plain socket speaking ZMTP 3.0 as a PUSH peer with the NULL
    mechanism (no key); True when the server hung up on it within ``wait_s``."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack("!I", 4) + b"PUSH"
        try:
            s.sendall(bytes([0x04, len(ready)]) + ready)
            s.sendall(b"\x02" + struct.pack("!Q", len(frame)) + frame)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not s.recv(4096):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


# -- config ---------------------------------------------------------------------------------------


def _core(name: str, **options: Any) -> CoreEngineBackend:
    return CoreEngineBackend(BackendConfig(name=name, kind="core_engine", options=_ENGINE | options))


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5601", "tcp://*:5601", "tcp://10.0.0.2:5601", "tcp://decode-host:5601"])
def test_a_non_loopback_kv_address_without_keys_is_a_config_error(address: str, tmp_path: Path) -> None:
    with pytest.raises(BackendConfigError, match=re.escape(f"kv_transfer.secret_key_file: {address} is not a loopback address")):
        _core("dc", role="decode", kv_transfer={"transport": "tcp", "address": address})
    keys = make_keys(tmp_path)
    _core("dc", role="decode", kv_transfer=decode_side(keys, address))  # with keys it is accepted
    with pytest.raises(ValueError, match="kv_transfer.server_key_file: CURVE needs the peer's keys"):
        KVTransferConfig(transport="tcp", address=address, secret_key_file=keys.decode_secret)
    with pytest.raises(KVTransferError, match="kv_transfer.authorized_keys_dir: the decode side needs"):
        open_receiver(KVTransferConfig(**prefill_side(keys, f"tcp://127.0.0.1:{_free_port()}")))


# -- a keyed decode engine --------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keyed_pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[dict[str, Any], int]]:
    keys = make_keys(tmp_path_factory.mktemp("keys"))
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    backends: dict[str, Any] = {
        "pf": _core("pf", role="prefill", kv_transfer=prefill_side(keys, address)),
        "dc": _core("dc", role="decode", kv_transfer=decode_side(keys, address, timeout_s=10.0)),
    }
    for backend in backends.values():
        await backend.start()
    pd = DisaggregatedBackend(
        BackendConfig(name="pd", kind="disaggregated", options={"prefill": "pf", "decode": "dc"})
    )
    pd.bind_backends(backends)
    await pd.start()
    backends["pd"] = pd
    yield backends, port
    for backend in backends.values():
        await backend.aclose()


def _chat(text: str) -> GenerationRequest:
    return GenerationRequest(
        request_id="r", model="m", kind="chat", messages=(ChatMessage(role="user", content=text),),
        params=SamplingParams(temperature=0.0, max_tokens=8),
    )


def test_the_raw_client_is_a_real_client_of_a_keyless_receiver() -> None:
    """The control for the test below: without keys (loopback), the same bytes land."""
    port = _free_port()
    receiver = open_receiver(KVTransferConfig(transport="tcp", address=f"tcp://127.0.0.1:{port}", timeout_s=5))
    try:
        assert not raw_zmtp_push(port, transfer_frame("injected", make_kv()), wait_s=0.5)
        assert torch.equal(receiver.receive("injected").data, make_kv().data)
    finally:
        receiver.close()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_raw_client_without_the_key_is_refused_and_the_engine_keeps_serving(
    keyed_pair: tuple[dict[str, Any], int],
) -> None:
    backends, port = keyed_pair
    receiver: TcpKVReceiver = backends["dc"]._kv_receiver
    assert raw_zmtp_push(port, transfer_frame("injected", make_kv())), "the decode engine did not hang up"
    # The disaggregated pair still goes through the same port (prefill -> KV -> decode).
    pd: DisaggregatedBackend = backends["pd"]
    text = ""
    async for chunk in pd.generate(_chat("Name three colours.")):
        text += chunk.text
    assert text and pd.num_disaggregated == 1 and pd.num_fallbacks == 0 and pd.num_retries == 0
    assert receiver.num_waiting == 0 and receiver.num_refused == 0  # the injected one never reached it
    with pytest.raises(KVTransferTimeout):
        receiver.receive("injected", timeout=0.2)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_peer_with_an_unknown_key_is_refused(
    keyed_pair: tuple[dict[str, Any], int], tmp_path: Path
) -> None:
    backends, port = keyed_pair
    receiver: TcpKVReceiver = backends["dc"]._kv_receiver
    _, stranger_secret = zmq.auth.create_certificates(str(tmp_path), "stranger")
    stranger = open_sender(KVTransferConfig(  # a valid key pair, and the decode engine's public key
        transport="tcp", address=f"tcp://127.0.0.1:{port}", timeout_s=1.0,
        secret_key_file=stranger_secret, server_key_file=receiver.config.secret_key_file,
    ))  # fmt: skip
    try:
        with pytest.raises(KVTransferError, match="is not taking transfers"):
            stranger.send("stranger", make_kv())
    finally:
        stranger.close()
    assert receiver.num_waiting == 0 and receiver.num_refused == 0


# -- bounds -----------------------------------------------------------------------------------------


def test_an_oversized_transfer_is_refused_and_the_receiver_keeps_serving(tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    address = f"tcp://127.0.0.1:{_free_port()}"
    limit = 1024 * 1024  # one block of make_kv (737 KiB) fits, three do not
    receiver = open_receiver(KVTransferConfig(**decode_side(keys, address, max_message_bytes=limit)))
    # A peer holding a key but not the limit (a misconfigured or hostile prefill engine).
    big = open_sender(KVTransferConfig(**prefill_side(keys, address, timeout_s=2.0, max_message_bytes=64 * limit)))
    careful = open_sender(KVTransferConfig(**prefill_side(keys, address, timeout_s=2.0, max_message_bytes=limit)))
    try:
        with pytest.raises(KVTransferError, match="more than kv_transfer.max_message_bytes"):
            careful.send("oversized", make_kv(3))  # the prefill side refuses it before sending
        big.send("oversized", make_kv(3))
        # Transfers sent after it on the same socket arrive after it, or not at all (the
        # receiver hung up on the oversized one, and ZeroMQ reconnects).
        probe = 0
        while True:
            probe += 1
            try:
                big.send(f"probe-{probe}", make_kv(1, seed=probe))
                got = receiver.receive(f"probe-{probe}", timeout=1.0)
                break
            except KVTransferError:
                assert probe < 30, "the receiver stopped taking transfers"
        assert torch.equal(got.data, make_kv(1, seed=probe).data)
        with pytest.raises(KVTransferTimeout):
            receiver.receive("oversized", timeout=0.2)
        # ZeroMQ hung up on it as its size arrived: it never reached the reader whole.
        assert isinstance(receiver, TcpKVReceiver) and receiver.num_refused == 0
        careful.send("fits", make_kv(1, seed=99))
        assert torch.equal(receiver.receive("fits").data, make_kv(1, seed=99).data)
    finally:
        big.close()
        careful.close()
        receiver.close()


def test_transfers_past_the_pending_cap_are_refused() -> None:
    config = KVTransferConfig(
        transport="tcp", address=f"tcp://127.0.0.1:{_free_port()}", timeout_s=5, max_pending_transfers=2
    )
    receiver = open_receiver(config)
    sender = open_sender(config)
    try:
        assert isinstance(receiver, TcpKVReceiver)
        for i in range(4):
            sender.send(f"t{i}", make_kv(1, seed=i))
        _wait_until(lambda: receiver.num_refused == 2, timeout_s=10)
        assert receiver.num_waiting == 2
        for i in (0, 1):
            assert torch.equal(receiver.receive(f"t{i}").data, make_kv(1, seed=i).data)
        for i in (2, 3):
            with pytest.raises(KVTransferTimeout):
                receiver.receive(f"t{i}", timeout=0.2)
        sender.send("t4", make_kv(1, seed=4))  # claimed ones made room
        assert torch.equal(receiver.receive("t4").data, make_kv(1, seed=4).data)
    finally:
        sender.close()
        receiver.close()


# -- tensor-parallel rendezvous -------------------------------------------------------------------


def _listening() -> set[str]:
    """This process's listening TCP sockets, ``host:port`` as ``ss`` prints them."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line}


def test_the_tensor_parallel_rendezvous_listens_on_loopback_only() -> None:
    before = _listening()
    listener = rendezvous_listener()
    port = listener.getsockname()[1]
    groups: dict[int, TensorParallelGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = TensorParallelGroup(
            rank=rank, world_size=2, port=port, device="cpu", timeout_s=20.0, listener=listener if rank == 0 else None
        )

    ranks = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout=60)
    assert sorted(groups) == [0, 1], "the group did not form"
    sums: dict[int, torch.Tensor] = {}
    reduce = [
        threading.Thread(target=lambda r=r: sums.setdefault(r, groups[r].all_reduce(torch.full((3,), r + 1.0))))
        for r in (0, 1)
    ]
    for t in reduce:
        t.start()
    for t in reduce:
        t.join(timeout=60)
    assert all(torch.equal(sums[r], torch.full((3,), 3.0)) for r in (0, 1))
    opened = _listening() - before
    assert f"127.0.0.1:{port}" in opened  # the store
    assert len(opened) > 1  # and gloo's listeners
    assert all(addr.startswith("127.0.0.1:") for addr in opened), opened
