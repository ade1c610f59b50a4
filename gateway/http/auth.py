"""API keys: who may call the API, checked before anything else runs.

Keys live in the config as ``[[auth.keys]]`` tables holding the SHA-256 of the key, never the
key itself (``infermux key new`` / ``infermux key hash``). A client sends its key as
``Authorization: Bearer <key>`` (what the OpenAI SDKs do) or ``x-api-key: <key>``.

The check hashes what was presented and compares it with *every* configured digest through
:func:`hmac.compare_digest`, without stopping at a match, so the time taken says nothing about
which key (or how much of one) matched. Anything else (no key, a wrong one, a key with control
characters or an absurd length) is a 401 ``invalid_api_key``.

Open mode: with no keys configured, nobody needs a key, and therefore only loopback clients
are served (403 for others), ``infermux serve`` refuses to listen on a non-loopback
address (:func:`check_exposure`), and requests a web page made a browser send (a ``Host`` or
``Origin`` that is not a loopback one) are refused on every path
(:mod:`gateway.http.local_origin`). Paths outside ``/v1/`` (``/health``, ``/ready``,
``/schema``, and ``/metrics`` unless ``[server] metrics_token_sha256`` asks for a token:
:func:`token_matches`) are public.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Scope

from backends.errors import AuthenticationError, PermissionDeniedError
from gateway.config.types import ApiKeyConfig, ConfigError, InfermuxConfig

__all__ = [
    "KEY_PREFIX",
    "KeyStore",
    "api_key_guard",
    "api_key_of",
    "authorize",
    "check_exposure",
    "generate_key",
    "hash_key",
    "is_loopback",
    "presented_key",
    "token_matches",
]

logger = logging.getLogger("gateway.auth")

#: Generated keys start with this, so that leaked keys are easy to grep for.
KEY_PREFIX = "imx-"
#: Longer presented keys are refused before hashing (no real key is anywhere near this).
_MAX_KEY_CHARS = 512
_SCOPE_KEY = "infermux.api_key"
_CHALLENGE = {"www-authenticate": 'Bearer realm="infermux"'}


def hash_key(key: str) -> str:
    """The ``key_sha256`` value for ``key``: lower-case hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_key() -> str:
    """A fresh random key (256 bits of entropy)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


@functools.lru_cache(maxsize=1024)
def is_loopback(host: str | None) -> bool:
    """``127.0.0.0/8``, ``::1`` and ``localhost``; ``None`` (a Unix socket) counts as local.

    Asked for every request in open mode; the answers are remembered (parsing an address
    costs more than the rest of the check)."""
    if host is None:
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(config: InfermuxConfig) -> None:
    """Refuse to serve an open gateway (no keys) on an address other machines can reach."""
    if config.auth.keys or is_loopback(config.server.host):
        return
    raise ConfigError(
        f"server.host: refusing to listen on {config.server.host!r} without API keys: anyone "
        "who can reach it could use the models. Add [[auth.keys]] tables (`infermux key new` "
        "prints one) or listen on 127.0.0.1",
        key="server.host",
    )


class KeyStore:
    """The configured keys; :meth:`authenticate` maps a presented key to its entry."""

    def __init__(self, keys: Sequence[ApiKeyConfig]) -> None:
        self._entries = [(bytes.fromhex(k.key_sha256), k) for k in keys]

    @property
    def is_open(self) -> bool:
        """No keys configured: no key is needed (loopback clients only)."""
        return not self._entries

    def authenticate(self, presented: str | None) -> ApiKeyConfig:
        """The entry of ``presented``, else :class:`AuthenticationError` (401)."""
        if presented is None:
            raise AuthenticationError(
                "no API key: send it as 'Authorization: Bearer <key>'", headers=_CHALLENGE
            )
        if not _is_plausible_key(presented):
            raise AuthenticationError("invalid API key", headers=_CHALLENGE)
        digest = hashlib.sha256(presented.encode("utf-8")).digest()
        found: ApiKeyConfig | None = None
        # Every digest is compared, match or not: the time taken does not depend on which.
        for stored, entry in self._entries:
            if hmac.compare_digest(stored, digest):
                found = entry
        if found is None:
            raise AuthenticationError("invalid API key", headers=_CHALLENGE)
        return found


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries (``Authorization: Bearer`` first, then ``x-api-key``).

    ``headers`` are looked up by lower-case name (Litestar's headers, or a plain dict of an
    ASGI scope's headers, whose names ASGI servers lower-case).
    """
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return ""  # present but unusable: a wrong key, not a missing one
        return value.strip()
    return headers.get("x-api-key")


def token_matches(presented: str | None, token_sha256: str) -> bool:
    """``presented`` is the token whose SHA-256 (hex) is ``token_sha256``; compared as the
    keys are (:meth:`KeyStore.authenticate`), in constant time."""
    if presented is None or not _is_plausible_key(presented):
        return False
    digest = hashlib.sha256(presented.encode("utf-8")).digest()
    return hmac.compare_digest(bytes.fromhex(token_sha256), digest)


def authorize(scope: Scope, headers: Mapping[str, str], store: KeyStore) -> ApiKeyConfig | None:
    """Authenticate a ``/v1/`` request; its key's entry (None in open mode), also kept in the
    scope for :func:`api_key_of`. 401 / 403 as :class:`AuthenticationError` /
    :class:`PermissionDeniedError`."""
    client = scope.get("client")
    host = client[0] if client else None
    if store.is_open:
        if not is_loopback(host):
            logger.warning("refused a request from %s: open mode serves loopback only", host)
            raise PermissionDeniedError(
                "this infermux has no API keys configured and serves only clients on the same "
                "machine"
            )
        return None
    try:
        entry = store.authenticate(presented_key(headers))
    except AuthenticationError:
        logger.info("refused a request from %s: missing or invalid API key", host)
        raise
    scope[_SCOPE_KEY] = entry  # type: ignore[literal-required]
    return entry


async def api_key_guard(
    connection: ASGIConnection[Any, Any, Any, Any], _handler: BaseRouteHandler
) -> None:
    """Litestar guard of the ``/v1/`` controllers (the generation endpoints call
    :func:`authorize` themselves): authenticate, remember the key's entry."""
    authorize(connection.scope, connection.headers, connection.app.state["gateway"].key_store)


def api_key_of(connection: ASGIConnection[Any, Any, Any, Any]) -> ApiKeyConfig | None:
    """The key entry the guard accepted for this request (None in open mode)."""
    entry: Any = connection.scope.get(_SCOPE_KEY)
    return entry if isinstance(entry, ApiKeyConfig) else None


def _is_plausible_key(key: str) -> bool:
    # Keys are printable ASCII; anything else (CR/LF, NUL, quotes are fine) cannot match.
    return 0 < len(key) <= _MAX_KEY_CHARS and key.isascii() and key.isprintable()
