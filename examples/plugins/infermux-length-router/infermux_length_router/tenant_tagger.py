"""``tenant-tagger``: the tenant of a request from a request header.

The gateway hands a request header to plugins only when the operator allow-lists it; the
tagger then reads it from the request's labels and sets ``GenerationRequest.tenant`` (which
the built-in cost plugin keeps usage and budgets per) and a ``tenant`` label::

    [plugins]
    request_headers = ["x-tenant-id"]

    [plugins.settings.tenant-tagger]
    header = "x-tenant-id"        # default
    label = "tenant"              # default

A request authenticated with an API key already has the key's tenant: a header never
overrides it (a client must not be able to bill another tenant). A malformed value is
rejected with 400 naming the header.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from plugins import GenerationRequest, InvalidRequestError, hookimpl

__all__ = ["TenantTagger", "TenantTaggerSettings", "create_plugin"]

PLUGIN_NAME = "tenant-tagger"
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


class TenantTaggerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[plugins.settings.tenant-tagger]``."""

    #: Must also be listed in ``[plugins] request_headers``.
    header: str = "x-tenant-id"
    label: str = "tenant"


class TenantTagger:
    """Answers ``infermux_transform_request``: tenant and label from the header."""

    def __init__(self, settings: TenantTaggerSettings) -> None:
        self.settings = settings
        self._label_key = settings.header.lower()

    @hookimpl
    def infermux_transform_request(self, request: GenerationRequest) -> GenerationRequest | None:
        value = request.labels.get(self._label_key)
        if value is None:
            return None
        if request.tenant is not None:  # from the API key: the authenticated identity wins
            tenant = request.tenant
        elif _TENANT.fullmatch(value):
            tenant = value
        else:
            raise InvalidRequestError(
                f"the {self.settings.header} header must be a tenant name (letters, digits, "
                "'_', '.', '-'; at most 64)",
                param=self.settings.header,
            )
        labels = {**request.labels, self.settings.label: tenant}
        return msgspec.structs.replace(request, tenant=tenant, labels=labels)


def create_plugin(settings: Mapping[str, Any] | None = None) -> TenantTagger:
    """Called by infermux once per gateway with ``[plugins.settings.tenant-tagger]``."""
    try:
        decoded = msgspec.convert(dict(settings or {}), TenantTaggerSettings)
    except msgspec.ValidationError as exc:
        raise ValueError(f"plugins.settings.{PLUGIN_NAME}: {exc}") from exc
    return TenantTagger(decoded)
