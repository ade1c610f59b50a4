"""Stored responses of the Responses API: ``store`` + ``previous_response_id``, ``GET`` and
``DELETE /v1/responses/{id}``.

One table, ``responses``, in the SQLite file of the usage ledger by default (``[cost]
ledger_path`` / ``$INFERMUX_LEDGER_PATH``, else ``var/ledger.sqlite3``): one file to back
up, and the same WAL mode. Each row is the response body as answered, the conversation it
ends (the chat messages a follow-up continues from, without ``instructions``, which OpenAI
does not carry over), and the API key id that created it: every read and delete is keyed
by (id, key), so a key never sees, continues or deletes another key's response (it gets
the same 404 as for an id that never existed). In open mode (no keys) the key is NULL.

Retention is bounded: rows older than ``max_age_s`` and, per key, all but the newest
``max_per_key`` are deleted when a response is stored. The file is opened on first use, so
a gateway that never stores a response creates nothing; it is created ``0600`` in a ``0700``
folder, and a folder or file that another user controls is refused
(:mod:`core_engine.private_files`). Calls are short SQLite statements
made on the caller's thread (a busy database waits at most ``_BUSY_TIMEOUT_S``).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from backends.errors import InfermuxError
from core_engine.private_files import private_dir, private_file

__all__ = ["ResponseStore", "StoredResponse"]

_BUSY_TIMEOUT_S = 2.0
#: OpenAI keeps stored responses for 30 days.
DEFAULT_MAX_AGE_S = 30 * 24 * 3600.0
DEFAULT_MAX_PER_KEY = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id           TEXT PRIMARY KEY,
    api_key_id   TEXT,
    created_at   REAL NOT NULL,
    body         BLOB NOT NULL,
    conversation BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_key ON responses (api_key_id, created_at);
"""


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    #: The response body as JSON bytes.
    body: bytes
    #: ``[{"role", "content"}, ...]``: the conversation up to and including this output.
    conversation: list[dict[str, Any]]


class ResponseStore:
    """The ``responses`` table of one SQLite file; thread-safe."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_per_key: int = DEFAULT_MAX_PER_KEY,
    ) -> None:
        self.path = Path(path)
        self.max_age_s = max_age_s
        self.max_per_key = max_per_key
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._connection is None:
            try:
                # The responses people were given: this user's alone (core_engine.private_files).
                private_dir(self.path.parent)
                private_file(self.path)
                connection = sqlite3.connect(
                    self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
                )
                connection.execute("PRAGMA journal_mode=WAL")
                connection.executescript(_SCHEMA)
            except (sqlite3.Error, OSError) as exc:
                raise InfermuxError(f"the response store {str(self.path)!r} cannot be opened: {exc}") from exc
            self._connection = connection
        return self._connection

    def put(
        self,
        response_id: str,
        api_key_id: str | None,
        body: bytes,
        conversation: list[dict[str, Any]],
    ) -> None:
        """Store a response, then apply the retention bounds."""
        now = time.time()
        with self._lock:
            connection = self._connect()
            try:
                connection.execute("BEGIN IMMEDIATE")
                connection.execute(
                    "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                    (response_id, api_key_id, now, body, msgspec.json.encode(conversation)),
                )
                connection.execute("DELETE FROM responses WHERE created_at < ?", (now - self.max_age_s,))
                connection.execute(
                    "DELETE FROM responses WHERE api_key_id IS ? AND id NOT IN (SELECT id FROM "
                    "responses WHERE api_key_id IS ? ORDER BY created_at DESC LIMIT ?)",
                    (api_key_id, api_key_id, self.max_per_key),
                )
                connection.execute("COMMIT")
            except sqlite3.Error as exc:
                if connection.in_transaction:
                    connection.execute("ROLLBACK")
                raise InfermuxError(f"the response could not be stored: {exc}") from exc

    def get(self, response_id: str, api_key_id: str | None) -> StoredResponse | None:
        """The response ``response_id`` created by ``api_key_id``, or None."""
        with self._lock:
            row = (
                self._connect()
                .execute(
                    "SELECT body, conversation, created_at FROM responses WHERE id = ? AND api_key_id IS ?",
                    (response_id, api_key_id),
                )
                .fetchone()
            )
        if row is None or row[2] < time.time() - self.max_age_s:
            return None
        return StoredResponse(body=bytes(row[0]), conversation=msgspec.json.decode(row[1]))

    def delete(self, response_id: str, api_key_id: str | None) -> bool:
        """Delete it; False when this key has no such response."""
        with self._lock:
            cursor = self._connect().execute(
                "DELETE FROM responses WHERE id = ? AND api_key_id IS ?", (response_id, api_key_id)
            )
        return cursor.rowcount > 0

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None
