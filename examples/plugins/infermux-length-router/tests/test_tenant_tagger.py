"""The tenant tagger: header -> tenant, through a live gateway."""

from __future__ import annotations

import msgspec
import openai
import pytest
from infermux_length_router.tenant_tagger import create_plugin

from gateway.config.types import PluginsConfig
from plugins import GenerationRequest, InvalidRequestError
from plugins.manager import PluginHooks
from plugins.testing import gateway_config, make_plugin_manager

REQUEST = GenerationRequest(request_id="r", model="m", kind="completion", prompt="hi")


async def transform(request: GenerationRequest) -> GenerationRequest:
    hooks = PluginHooks(make_plugin_manager(create_plugin({})))
    return await hooks.transform_request(request=request)


async def test_the_header_label_sets_the_tenant_and_a_tenant_label() -> None:
    tagged = await transform(msgspec.structs.replace(REQUEST, labels={"x-tenant-id": "acme"}))
    assert tagged.tenant == "acme"
    assert tagged.labels["tenant"] == "acme"


async def test_an_api_key_tenant_is_never_overridden_by_the_header() -> None:
    keyed = msgspec.structs.replace(REQUEST, tenant="payer", labels={"x-tenant-id": "other"})
    tagged = await transform(keyed)
    assert tagged.tenant == "payer"
    assert tagged.labels["tenant"] == "payer"


async def test_without_the_header_the_request_is_unchanged() -> None:
    assert await transform(REQUEST) == REQUEST


async def test_a_malformed_tenant_is_rejected_naming_the_header() -> None:
    bad = msgspec.structs.replace(REQUEST, labels={"x-tenant-id": "no spaces please"})
    with pytest.raises(InvalidRequestError) as caught:
        await transform(bad)
    assert caught.value.param == "x-tenant-id"


def test_a_live_gateway_tags_the_tenant_from_the_allow_listed_header(
    plugin_gateway, hook_recorder
) -> None:
    config = gateway_config(plugins=PluginsConfig(request_headers=["X-Tenant-Id"]))
    with plugin_gateway(create_plugin({}), hook_recorder, config=config) as gateway:
        client = gateway.openai_client(default_headers={"X-Tenant-Id": "acme"})
        client.completions.create(model="echo", prompt="hello", max_tokens=2)
        request = hook_recorder.wait_for("on_response")["request"]
        rejected = gateway.openai_client(default_headers={"X-Tenant-Id": "a b"})
        with pytest.raises(openai.BadRequestError) as caught:
            rejected.completions.create(model="echo", prompt="hello", max_tokens=2)
    assert request.tenant == "acme"
    assert request.labels["tenant"] == "acme"
    assert "x-tenant-id" in caught.value.message.lower()
