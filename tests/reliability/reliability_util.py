"""Helpers shared by the reliability suites (a live gateway is always the thing under test)."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import msgspec

from plugins.builtin.cost.config import CostConfig
from plugins.hookspecs import hookimpl
from plugins.manager import create_plugin_manager

NORMAL_MESSAGES = [{"role": "user", "content": "still serving"}]


def envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    """The ``error`` object of an OpenAI envelope answered with ``status``."""
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "echo", "messages": NORMAL_MESSAGES, **fields}


def assert_still_serving(
    base_url: str, *, headers: Mapping[str, str] | None = None, model: str = "echo"
) -> None:
    """A normal request right after the fault is answered normally."""
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": model, "messages": NORMAL_MESSAGES, "max_tokens": 8},
        headers=dict(headers or {}),
        timeout=60,
    )
    assert response.status_code == 200, response.text[:500]
    assert response.json()["choices"][0]["message"]["content"]


def sse_frames(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a streamed response, in order."""
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` (the work happens on the server's thread); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


class Recorder:
    """A plugin recording every ``on_response`` / ``on_error`` with its usage (the usage
    record a cost ledger writes: one per choice that reached a backend)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []

    @hookimpl
    async def infermux_on_response(
        self, request: Any, backend_name: str, usage: Any, finish_reason: str | None
    ) -> None:
        with self._lock:
            self.responses.append(
                {
                    "request": request,
                    "backend": backend_name,
                    "usage": usage,
                    "finish": finish_reason,
                }
            )

    @hookimpl
    async def infermux_on_error(
        self, request: Any, backend_name: str | None, error: Exception, usage: Any
    ) -> None:
        with self._lock:
            self.errors.append(
                {"request": request, "backend": backend_name, "error": error, "usage": usage}
            )

    @property
    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return self.responses + self.errors

    def records_of(self, request_id: str) -> list[dict[str, Any]]:
        """Records of one HTTP request (choice ids are ``<id>`` or ``<id>.<k>``)."""
        return [
            r
            for r in self.records
            if r["request"].request_id == request_id
            or r["request"].request_id.startswith(request_id + ".")
        ]


def recording_plugins(*others: object) -> tuple[Any, Recorder]:
    """A plugin manager with the built-ins, ``others`` and a :class:`Recorder`."""
    pm = create_plugin_manager(load_entry_points=False)
    for index, plugin in enumerate(others):
        pm.register(plugin, name=f"test-plugin-{index}")
    recorder = Recorder()
    pm.register(recorder, name="recorder")
    return pm, recorder


def with_ledger(config: Any, path: Path) -> Any:
    """``config`` with the built-in cost plugin's usage ledger at ``path``."""
    return msgspec.structs.replace(config, cost=CostConfig(ledger_path=str(path)))


def ledger_rows(path: Path, request_id: str | None = None) -> list[dict[str, Any]]:
    """The usage ledger's rows (all, or those of one HTTP request), read-only."""
    if not path.exists():
        return []
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    connection.row_factory = sqlite3.Row
    try:
        if request_id is None:
            rows = connection.execute("SELECT * FROM usage_records").fetchall()
        else:
            rows = connection.execute(
                "SELECT * FROM usage_records WHERE request_id = ?", (request_id,)
            ).fetchall()
    finally:
        connection.close()
    return [dict(row) for row in rows]
