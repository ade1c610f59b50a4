"""Bad input, class by class (docs/reliability-cases.md "Bad input"), through a live gateway.

Every case asserts the status, the OpenAI envelope and the ``param`` it names; after every
test the same server must still answer a normal request (the autouse fixture).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from reliability_util import assert_still_serving, chat_body, envelope
from upstream_server import UpstreamServer

from gateway.config.types import LimitsConfig, ServerConfig
from gateway.testing import LiveGateway, gateway_config, mock_backend

LIMITS = LimitsConfig(
    max_n=4,
    max_choices=8,
    max_stop_sequences=4,
    max_stop_chars=50,
    max_top_logprobs=5,
    max_header_bytes=8 * 1024,
    max_messages=8,
    max_output_tokens=1000,
    max_response_format_bytes=2048,
    max_response_format_depth=8,
)


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    config = gateway_config(
        mock_backend("mock", context_length=64),
        server=ServerConfig(max_body_bytes=2 * 1024 * 1024),
        limits=LIMITS,
    )
    with live_gateway(config) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def http(gw: LiveGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gw, timeout=60.0) as client:
        yield client


@pytest.fixture(autouse=True)
def still_serving_afterwards(gw: LiveGateway) -> Iterator[None]:
    yield
    assert_still_serving(gw)


def post_raw(
    http: httpx.Client, content: bytes, path: str = "/v1/chat/completions"
) -> httpx.Response:
    return http.post(path, content=content, headers={"content-type": "application/json"})


def chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json=chat_body(**fields))


# -- unparsable body ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"hello", "application/json"),
        (b'{"model": "echo", "messages": [{"role": "us', "application/json"),
        (b"\x00\xff\xfe\x80garbage", "application/json"),
        (b'{"model": "echo",}', "application/json"),
        (b"", "application/json"),
        (b'"just a string"', "application/json"),
    ],
)
def test_unparsable_body_is_400(http: httpx.Client, content: bytes, content_type: str) -> None:
    response = http.post(
        "/v1/chat/completions", content=content, headers={"content-type": content_type}
    )
    error = envelope(response, 400)
    assert error["type"] == "invalid_request_error"


def test_a_form_body_is_415_before_it_is_read(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions",
        content=b"model=echo&messages=hi",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert envelope(response, 415)["code"] == "unsupported_media_type"


# -- hostile JSON -------------------------------------------------------------------------

DEEP_ARRAYS = b'{"model": "echo", "messages": [], "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
DEEP_OBJECTS = b'{"model": "echo", "x": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}"


@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
        b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}',
        b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "seed": 1e999}',
        b'{"model": "echo", "messages": [{"role": "user", "content": "a \\ud800 b"}]}',
        b'{"model": "echo", "messages": [{"role": "user", "content": "\\udfff"}]}',
        b'{"model": "\\ud83d", "messages": [{"role": "user", "content": "x"}]}',
        DEEP_ARRAYS,
        DEEP_OBJECTS,
    ],
    ids=[
        "nan",
        "infinity",
        "minus-infinity",
        "overflow",
        "lone-high-surrogate",
        "lone-low-surrogate",
        "surrogate-model",
        "deep-arrays",
        "deep-objects",
    ],
)
def test_hostile_json_is_400(http: httpx.Client, content: bytes) -> None:
    error = envelope(post_raw(http, content), 400)
    assert error["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (
            b'{"model": "nope", "model": "echo", "messages": [{"role": "user", "content": "x"}]}',
            "model",
        ),
        (
            b'{"model": "echo", "messages": [{"role": "user", "role": "system", "content": "x"}]}',
            "role",
        ),
        (
            b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": 1, "max_tokens": 900}',
            "max_tokens",
        ),
    ],
    ids=["top-level", "nested", "number"],
)
def test_duplicate_keys_are_400_naming_the_key(
    http: httpx.Client, content: bytes, param: str
) -> None:
    error = envelope(post_raw(http, content), 400)
    assert error["param"] == param
    assert "twice" in error["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"n": [2]}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"logprobs": {"on": True}}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
    ],
)
def test_values_of_the_wrong_json_type_name_the_field(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    assert envelope(chat(http, **fields), 400)["param"] == param


# -- oversized ----------------------------------------------------------------------------


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    big = [{"role": "user", "content": "x" * (3 * 1024 * 1024)}]
    error = envelope(chat(http, messages=big), 413)
    assert error["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413(http: httpx.Client) -> None:
    # No content-length: the limit must hold while the body streams in.
    def pieces() -> Iterator[bytes]:
        yield b'{"model": "echo", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}]}'

    response = http.post(
        "/v1/chat/completions", content=pieces(), headers={"content-type": "application/json"}
    )
    assert envelope(response, 413)["code"] == "request_too_large"


@pytest.mark.parametrize(
    "headers",
    [
        {"x-padding": "p" * 10_000},
        {f"x-h{i}": "v" * 40 for i in range(300)},
        {"cookie": "c=" + "z" * 9000},
    ],
    ids=["one-huge-header", "many-headers", "huge-cookie"],
)
def test_huge_headers_are_431(http: httpx.Client, headers: dict[str, str]) -> None:
    response = http.post("/v1/chat/completions", json=chat_body(), headers=headers)
    error = envelope(response, 431)
    assert error["code"] == "request_header_fields_too_large"


def test_huge_query_string_is_431(http: httpx.Client) -> None:
    response = http.get("/v1/models", params={"q": "a" * 10_000})
    assert envelope(response, 431)["code"] == "request_header_fields_too_large"


def test_headers_beyond_the_parser_limit_are_refused_without_harm(gw: LiveGateway) -> None:
    # Past 4x the limit uvicorn itself refuses (a bare 400): nothing is buffered unbounded.
    host, port = gw.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"b" * 300_000 + b"\r\n\r\n"
        )
        status_line = sock.recv(200).split(b"\r\n", 1)[0]
    assert status_line.split()[1] in (b"400", b"431")


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:  # the gateway runs in this process (a thread)
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_an_unterminated_64_mb_header_is_refused_while_it_arrives(gw: LiveGateway) -> None:
    # httptools has no head limit of its own: the protocol counts and refuses at the cap,
    # so the 64 MB never pile up in the server (it once buffered them all, with no reply).
    host, port = gw.removeprefix("http://").split(":")
    piece = b"c" * (1 << 20)
    before = _rss_bytes()
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ")
            for _ in range(64):
                sock.sendall(piece)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed while we were still sending: what is wanted
        reply = b""
        try:
            while chunk := sock.recv(4096):
                reply += chunk
        except ConnectionResetError:
            pass
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert b"request_header_fields_too_large" in reply
    assert _rss_bytes() - before < 16 * 2**20


# -- unknown model ------------------------------------------------------------------------


class _FileAudit:
    """Records file-system access the gateway process makes while armed (an audit hook)."""

    def __init__(self) -> None:
        self.armed = False
        self.seen: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.armed or event not in ("open", "os.listdir", "os.scandir", "os.chdir"):
            return
        path = str(args[0]) if args else ""
        if "passwd" in path or "win.ini" in path or "etc" in path.split("/"):
            with self._lock:
                self.seen.append((event, path))


_AUDIT = _FileAudit()

PATH_LIKE_MODELS = [
    "../../etc/passwd",
    "/etc/passwd",
    "file:///etc/passwd",
    "..\\..\\windows\\win.ini",
    "%2e%2e%2fetc%2fpasswd",
    "echo/../../etc/passwd",
    "~/.ssh/id_rsa",
]


@pytest.mark.parametrize("model", ["nope", "ECHO", "echo ", "x" * 10_000, *PATH_LIKE_MODELS])
def test_unknown_model_is_404_and_never_touches_the_filesystem(
    http: httpx.Client, model: str
) -> None:
    _AUDIT.armed = True
    try:
        chat_error = envelope(chat(http, model=model), 404)
        completion = http.post("/v1/completions", json={"model": model, "prompt": "x"})
        completion_error = envelope(completion, 404)
    finally:
        _AUDIT.armed = False
    for error in (chat_error, completion_error):
        assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert _AUDIT.seen == []


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models/..%2F..%2Fetc%2Fpasswd",
        "/v1/models/%2Fetc%2Fpasswd",
        "/v1/models/org/..%2F..%2Fsecret",
    ],
)
def test_model_lookup_by_path_like_id_is_404(http: httpx.Client, path: str) -> None:
    _AUDIT.armed = True
    try:
        error = envelope(http.get(path), 404)
    finally:
        _AUDIT.armed = False
    assert error["code"] == "model_not_found"
    assert _AUDIT.seen == []


# -- shape --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": None, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "   ", "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "echo"}, "messages"),
        ({"model": "echo", "messages": []}, "messages"),
        ({"model": "echo", "messages": "hello"}, "messages"),
        ({"model": "echo", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "echo", "messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        ({"model": "echo", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"model": "echo", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"model": "echo", "messages": [{"role": "user", "content": {"a": 1}}]},
            "messages[0].content",
        ),
        ({"model": "echo", "messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {"model": "echo", "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
            "messages[0].content",
        ),
        ({"model": "echo", "messages": [{"role": "user", "content": "x"}] * 9}, "messages"),
    ],
)
def test_malformed_chat_shapes_name_the_param(
    http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    response = http.post("/v1/chat/completions", json=body)
    error = envelope(response, 400)
    assert error["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "echo"}, "prompt"),
        ({"model": "echo", "prompt": {"text": "x"}}, "prompt"),
        ({"model": "echo", "prompt": []}, "prompt"),
        ({"model": "echo", "prompt": [[]]}, "prompt[0]"),
    ],
)
def test_malformed_completion_shapes_name_the_param(
    http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    error = envelope(http.post("/v1/completions", json=body), 400)
    assert error["param"] == param


# -- ranges -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"max_tokens": 1001}, "max_tokens"),  # over [limits] max_output_tokens
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
        ({"n": 10**6}, "n"),
        ({"n": 5}, "n"),  # over [limits] max_n
        ({"n": 0}, "n"),
        ({"logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),  # over max_top_logprobs
        ({"temperature": 1e6}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": -1}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"min_p": 2}, "min_p"),
    ],
)
def test_out_of_range_parameters_name_the_param(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    error = envelope(chat(http, **fields), 400)
    assert error["param"] == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 1001}, "max_tokens"),
        ({"logprobs": 10**6}, "logprobs"),
        ({"n": 3, "prompt": ["a", "b", "c"]}, "prompt"),  # over max_choices
    ],
)
def test_completion_ranges_name_the_param(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    body = {"model": "echo", "prompt": "x", **fields}
    assert envelope(http.post("/v1/completions", json=body), 400)["param"] == param


# -- context ------------------------------------------------------------------------------


def test_prompt_plus_max_tokens_beyond_the_context_is_400(http: httpx.Client) -> None:
    error = envelope(
        chat(http, max_tokens=60, messages=[{"role": "user", "content": "a b c d e"}]), 400
    )
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")


def test_prompt_alone_beyond_the_context_is_400(http: httpx.Client) -> None:
    long_text = " ".join(f"w{i}" for i in range(100))
    error = envelope(chat(http, messages=[{"role": "user", "content": long_text}]), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    completion = http.post("/v1/completions", json={"model": "echo", "prompt": list(range(100))})
    error = envelope(completion, 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")


# -- stop ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stop",
    [
        ["s"] * 100_000,
        "x" * 1_000_000,
        ["a", "b", "c", "d", "e"],
        ["ok", "y" * 51],
        [""],
        [1, 2],
        {"a": "b"},
    ],
    ids=["1e5-strings", "1MB-string", "over-count", "over-length", "empty", "ints", "object"],
)
def test_bad_stop_is_400_naming_stop(http: httpx.Client, stop: Any) -> None:
    # A wrongly typed element is named precisely: "stop[0]".
    assert envelope(chat(http, stop=stop), 400)["param"].split("[")[0] == "stop"
    completion = http.post("/v1/completions", json={"model": "echo", "prompt": "x", "stop": stop})
    assert envelope(completion, 400)["param"].split("[")[0] == "stop"


# -- structured output --------------------------------------------------------------------


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "regex", "regex": "(a+)+$"}, "response_format.type"),
        ({"type": "grammar", "grammar": "root ::= root root"}, "response_format.type"),
        ({}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": 5}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": {}}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "http://127.0.0.1:1/s.json"}},
            },
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(20)}},
            "response_format",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"enum": ["v" * 100] * 40}},
            },
            "response_format",
        ),
    ],
)
def test_invalid_or_pathological_response_format_is_400(
    http: httpx.Client, response_format: dict[str, Any], param: str
) -> None:
    error = envelope(chat(http, response_format=response_format), 400)
    assert error["param"] == param


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_object"},
        {
            "type": "json_schema",
            "json_schema": {
                "name": "evil",
                "schema": {"type": "string", "pattern": "^(a+)+$"},
            },
        },
    ],
)
def test_structured_output_on_a_backend_without_it_is_400_unsupported(
    http: httpx.Client, response_format: dict[str, Any]
) -> None:
    error = envelope(chat(http, response_format=response_format), 400)
    assert (error["code"], error["param"]) == ("unsupported_parameter", "response_format")


def test_plain_text_response_format_is_accepted(http: httpx.Client) -> None:
    assert chat(http, response_format={"type": "text"}).status_code == 200


@pytest.mark.parametrize("field", ["regex", "ebnf", "json_schema", "guided_decoding_backend"])
def test_other_servers_constraint_fields_are_refused_not_ignored(http: httpx.Client, field: str) -> None:
    error = envelope(chat(http, **{field: "(a+)+$"}), 400)
    assert (error["code"], error["param"]) == ("unsupported_parameter", field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_json", {"type": "object"}),
        ("guided_regex", "(a+)+$"),
        ("guided_choice", ["yes", "no"]),
        ("guided_grammar", 'start: "a"+'),
        ("structured_outputs", {"regex": "[0-9]+"}),
    ],
)
def test_vllm_constraint_fields_on_a_backend_without_structured_outputs_are_400_naming_them(
    http: httpx.Client, field: str, value: Any
) -> None:
    error = envelope(chat(http, **{field: value}), 400)
    assert (error["code"], error["param"]) == ("unsupported_parameter", field)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_json": 5}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"lark": "x"}}, "structured_outputs.lark"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": {"a": [[[[[[[[[[1]]]]]]]]]]}}, "guided_json"),
    ],
)
def test_malformed_or_doubled_constraints_are_400_naming_the_field(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    error = envelope(chat(http, **fields), 400)
    assert error["param"] == param


# -- smuggling ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def internal_service() -> Iterator[UpstreamServer]:
    """Stands for an internal address a request tries to make the gateway reach."""
    with UpstreamServer(name="internal") as server:
        yield server


@pytest.mark.parametrize(
    "field",
    ["api_base", "base_url", "api_key", "api_version", "chat_template"],
)
def test_smuggled_fields_are_refused_and_nothing_is_fetched(
    http: httpx.Client, internal_service: UpstreamServer, field: str
) -> None:
    value: Any = internal_service.base_url
    if field == "chat_template":
        value = "{{ cycler.__init__.__globals__.os.popen('id').read() }}"
    for path, body in (
        ("/v1/chat/completions", chat_body(**{field: value})),
        ("/v1/completions", {"model": "echo", "prompt": "x", field: value}),
    ):
        error = envelope(http.post(path, json=body), 400)
        assert error["param"] == field
    assert internal_service.requests == []


def test_template_variables_are_data_and_fetch_nothing(
    http: httpx.Client, internal_service: UpstreamServer
) -> None:
    # chat_template_kwargs (vLLM's field) fills the model's own template's variables: a URL
    # there is a string, never a request; names the server sets are refused.
    body = chat_body(chat_template_kwargs={"url": internal_service.base_url, "enable_thinking": False})
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    reserved = chat_body(chat_template_kwargs={"messages": []})
    assert envelope(http.post("/v1/chat/completions", json=reserved), 400)["param"] == "chat_template_kwargs"
    assert internal_service.requests == []


def test_urls_to_internal_addresses_are_never_fetched(
    http: httpx.Client, internal_service: UpstreamServer
) -> None:
    url = f"{internal_service.base_url}/secret.png"
    image = [{"type": "image_url", "image_url": {"url": url}}]
    assert (
        envelope(chat(http, messages=[{"role": "user", "content": image}]), 400)["param"]
        == "messages[0].content"
    )
    remote_ref = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": url}}}
    envelope(chat(http, response_format=remote_ref), 400)
    # Text that merely mentions a URL is ordinary text: echoed, never followed.
    answer = chat(http, messages=[{"role": "user", "content": url}])
    assert answer.status_code == 200
    assert json.loads(answer.text)["choices"][0]["message"]["content"] == url
    assert internal_service.requests == []
