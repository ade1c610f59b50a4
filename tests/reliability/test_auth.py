"""API keys: 401 for anything but a configured key, open mode only on loopback, key tooling."""

from __future__ import annotations

import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from reliability_util import assert_still_serving, chat_body, envelope

from gateway.app import create_app
from gateway.config.types import ApiKeyConfig, AuthConfig, ConfigError, ServerConfig
from gateway.http import auth
from gateway.http.auth import KeyStore, check_exposure, hash_key
from gateway.testing import LiveGateway, gateway_config, mock_backend

ALICE = "imx-alice-0123456789"
BOB = "imx-bob-9876543210"
KEYS = AuthConfig(
    keys=[
        ApiKeyConfig(id="alice", tenant="acme", key_sha256=hash_key(ALICE)),
        ApiKeyConfig(id="bob", tenant="beta", key_sha256=hash_key(BOB).upper()),
    ]
)


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    with live_gateway(gateway_config(mock_backend("mock"), auth=KEYS)) as gateway:
        yield gateway


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("wrong"),
        {"authorization": "Bearer"},
        {"authorization": f"Basic {ALICE}"},
        {"authorization": ALICE},
        bearer(ALICE[:-1]),
        bearer(ALICE + "x"),
        bearer(hash_key(ALICE)),  # knowing the stored hash is not knowing the key
        bearer("' OR '1'='1' --"),
        bearer('{"$ne": null}'),
        bearer("*"),
        bearer("k" * 5000),
        {"authorization": "Bearer ключ-ALICE".encode()},  # type: ignore[dict-item]
        {"x-api-key": "wrong"},
        {"x-api-key": ""},
    ],
    ids=lambda h: repr(h)[:40],
)
def test_missing_wrong_and_injection_shaped_keys_are_401(
    gw: LiveGateway, headers: dict[str, str]
) -> None:
    backend = gw.backend("mock")
    started = backend.num_started
    for method, path, body in (
        ("POST", "/v1/chat/completions", chat_body()),
        ("POST", "/v1/completions", {"model": "echo", "prompt": "x"}),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/echo", None),
    ):
        response = httpx.request(method, f"{gw}{path}", json=body, headers=headers, timeout=30)
        error = envelope(response, 401)
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert ALICE not in response.text
    assert backend.num_started == started  # nothing reached the backend
    assert_still_serving(gw, headers=bearer(ALICE))


@pytest.mark.parametrize(
    "raw_value",
    [b"Bearer " + ALICE.encode() + b"\x00", b"Bearer \xff\xfe" + ALICE.encode(), b"Bearer \t" * 50],
    ids=["nul", "latin1", "tabs"],
)
def test_byte_level_hostile_keys_never_authenticate(gw: LiveGateway, raw_value: bytes) -> None:
    host, port = gw.removeprefix("http://").split(":")
    body = b'{"model": "echo", "messages": [{"role": "user", "content": "x"}]}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"authorization: " + raw_value + b"\r\nconnection: close\r\n\r\n" + body
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    assert status in (400, 401)  # h11 itself may refuse the header; never a 200
    assert_still_serving(gw, headers=bearer(ALICE))


def test_a_configured_key_is_accepted_either_way_and_names_its_tenant(gw: LiveGateway) -> None:
    backend = gw.backend("mock")
    client = gw.openai_client(api_key=ALICE)
    assert client.chat.completions.create(model="echo", messages=chat_body()["messages"])
    assert (backend.received[-1].api_key_id, backend.received[-1].tenant) == ("alice", "acme")
    # An upper-case key_sha256 in the config is the same digest; x-api-key works too.
    response = httpx.post(
        f"{gw}/v1/completions", json={"model": "echo", "prompt": "hi"}, headers={"x-api-key": BOB}
    )
    assert response.status_code == 200
    assert (backend.received[-1].api_key_id, backend.received[-1].tenant) == ("bob", "beta")


def test_the_official_client_sees_an_authentication_error(gw: LiveGateway) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        gw.openai_client(api_key="sk-not-ours").models.list()
    assert caught.value.code == "invalid_api_key"


def test_the_key_is_checked_before_the_body(gw: LiveGateway) -> None:
    # Unauthenticated clients learn nothing about validation and cannot make us read 4 MB.
    for content in (b"not json", b"x" * (5 * 1024 * 1024)):
        response = httpx.post(
            f"{gw}/v1/chat/completions",
            content=content,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert envelope(response, 401)["code"] == "invalid_api_key"


def test_probes_and_the_schema_need_no_key(gw: LiveGateway) -> None:
    for path in ("/health", "/ready", "/schema/openapi.json"):
        assert httpx.get(f"{gw}{path}").status_code == 200, path


def test_every_configured_digest_is_compared_whichever_key_is_presented(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = [ApiKeyConfig(id=f"k{i}", key_sha256=hash_key(f"key-{i}")) for i in range(5)]
    store = KeyStore(keys)
    calls: list[int] = []
    real = auth.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented, expected in (("key-0", "k0"), ("key-4", "k4"), ("nope", None)):
        calls.clear()
        if expected is None:
            with pytest.raises(auth.AuthenticationError):
                store.authenticate(presented)
        else:
            assert store.authenticate(presented).id == expected
        assert len(calls) == len(keys)  # no early exit on a match: the timing says nothing


@pytest.mark.parametrize(
    ("client_host", "status"),
    [
        ("127.0.0.1", 200),
        ("::1", 200),
        ("203.0.113.9", 403),
        ("10.0.0.7", 403),
        ("::ffff:8.8.8.8", 403),
    ],
)
async def test_open_mode_serves_loopback_clients_only(client_host: str, status: int) -> None:
    app = create_app(gateway_config(mock_backend("mock")))
    transport = httpx.ASGITransport(app=app, client=(client_host, 40000))
    # A loopback Host: open mode also refuses any other (tests/security).
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        response = await client.get("/v1/models")
        assert response.status_code == status
        if status == 403:
            assert envelope(response, 403)["code"] == "permission_denied"
        assert (await client.get("/health")).status_code == 200


def test_open_mode_may_not_listen_beyond_loopback() -> None:
    open_config = gateway_config(mock_backend("mock"))
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.org"):
        exposed = gateway_config(mock_backend("mock"), server=ServerConfig(host=host))
        with pytest.raises(ConfigError, match="server.host"):
            check_exposure(exposed)
        keyed = gateway_config(mock_backend("mock"), server=ServerConfig(host=host), auth=KEYS)
        check_exposure(keyed)  # with keys it may
    check_exposure(open_config)


def _infermux(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_serve_refuses_to_start_open_on_a_public_address(tmp_path: Path) -> None:
    config = tmp_path / "mock.toml"
    config.write_text(
        '[[backends]]\nname = "mock"\nkind = "mock"\n[[models]]\nalias = "echo"\n'
        'backends = ["mock"]\n'
    )
    result = _infermux("serve", "--config", str(config), "--host", "0.0.0.0", "--port", "0")
    assert result.returncode == 2
    assert "server.host" in result.stderr
    assert "infermux key new" in result.stderr


def test_key_new_and_key_hash_make_a_working_config(live_gateway: Any) -> None:
    made = _infermux("key", "new", "--id", "cli-key", "--tenant", "ops", "--rpm", "50")
    assert made.returncode == 0, made.stderr
    key = made.stdout.split("it is shown only now): ", 1)[1].split()[0]
    table = tomllib.loads(made.stdout)["auth"]["keys"][0]
    assert table["key_sha256"] == hash_key(key)
    assert key not in str(table)  # only its hash goes into the config
    hashed = _infermux("key", "hash", stdin=key + "\n")
    assert hashed.stdout.strip() == table["key_sha256"]

    keys = AuthConfig(keys=[ApiKeyConfig(**table)])
    with live_gateway(gateway_config(mock_backend("mock"), auth=keys)) as gw:
        assert_still_serving(gw, headers=bearer(key))
        assert gw.backend("mock").received[-1].tenant == "ops"
        envelope(httpx.get(f"{gw}/v1/models", headers=bearer(key + "?")), 401)
