"""Structured outputs on the core engine with the real default model (llguidance masks).

Every constrained output that ends by itself (not cut by ``max_tokens``) parses and
validates: 31 JSON schemas checked with ``jsonschema``, regexes and choices matched, a Lark
and a GBNF grammar. Constraints llguidance rejects or that break a limit are an
``InvalidParamError`` naming the request field, in bounded time, never a hang.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from core_engine.errors import InvalidParamError
from core_engine.llm_engine import LLMEngine
from core_engine.sampling_params import SamplingParams
from core_engine.structured import StructuredOutput
from tests.core_engine.engine_util import make_engine, run_all
from tests.core_engine.structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    from backends.default_model import default_model_path

    return make_engine(Path(default_model_path()), dtype="auto", weight_format="auto")


def test_every_schema_output_validates(engine: LLMEngine) -> None:
    prompts, params = {}, {}
    for i, (name, what, schema) in enumerate(SCHEMAS):
        prompts[name] = chat(f"Reply with {what} as JSON.")
        # Greedy and sampled rows in one batch: the masks apply to both.
        params[name] = SamplingParams(
            max_tokens=160, temperature=0.0 if i % 2 else 0.7, seed=i,
            structured_outputs=StructuredOutput(json=schema, param="response_format"),
        )
    results = run_all(engine, prompts, params)
    finished = 0
    for name, _, schema in SCHEMAS:
        final = results[name]["final"]
        if final.finish_reason == "length":
            continue  # cut by max_tokens: allowed not to parse
        finished += 1
        assert final.finish_reason == "stop", name
        jsonschema.validate(json.loads(results[name]["text"]), schema)
    assert finished >= len(SCHEMAS) - 3, f"only {finished} of {len(SCHEMAS)} finished"


def test_json_object_regex_choice_and_grammars_always_match(engine: LLMEngine) -> None:
    cases = {
        "object": (StructuredOutput(json_object=True), chat("Describe a cat as JSON.")),
        "regex": (StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,4}"), chat("Give me a code.")),
        "catastrophic": (StructuredOutput(regex=r"(a+)+b"), chat("Say something.")),
        "choice": (StructuredOutput(choice=("Paris", "London", "Rome")), chat("What is the capital of France?")),
        "lark": (StructuredOutput(grammar='start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]+/'), chat("Is it?")),
        "gbnf": (StructuredOutput(grammar='root ::= "(" [a-z]+ ")"'), chat("A word in brackets.")),
    }
    # A sampled JSON object can run long (which fields it invents depends on the CPU's
    # roundings): more room for it; cut by max_tokens it is "length", never invalid and "stop".
    params = {
        k: SamplingParams(max_tokens=160 if k == "object" else 48, temperature=0.8, seed=3, structured_outputs=c)
        for k, (c, _) in cases.items()
    }
    results = run_all(engine, {k: p for k, (_, p) in cases.items()}, params)
    if results["object"]["final"].finish_reason != "length":
        assert isinstance(json.loads(results["object"]["text"]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", results["regex"]["text"])
    assert re.fullmatch(r"a+b", results["catastrophic"]["text"]) or results["catastrophic"]["final"].finish_reason == "length"
    assert results["choice"]["text"] in ("Paris", "London", "Rome")
    assert re.fullmatch(r"yes|no|maybe [0-9]+", results["lark"]["text"])
    assert re.fullmatch(r"\([a-z]+\)", results["gbnf"]["text"]) or results["gbnf"]["final"].finish_reason == "length"


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutput(regex="(unclosed", param="guided_regex"), "guided_regex"),
        (StructuredOutput(grammar="start: undefined_rule", param="guided_grammar"), "guided_grammar"),
        (StructuredOutput(json='{"type": ', param="guided_json"), "not JSON"),
        (StructuredOutput(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, param="response_format"),
         "response_format"),
        (StructuredOutput(json={"enum": [f"value-{i}" for i in range(20000)]}, param="response_format"), "bytes"),
    ],
    ids=["bad-regex", "bad-grammar", "not-json", "dangling-ref", "huge-enum"],
)
def test_rejected_or_oversized_constraints_are_errors_naming_the_field(
    engine: LLMEngine, constraint: StructuredOutput, message: str
) -> None:
    with pytest.raises(InvalidParamError, match=message) as info:
        engine.make_request("bad", chat("x"), SamplingParams(structured_outputs=constraint))
    assert info.value.param == constraint.param


def test_pathological_but_valid_schemas_compile_and_hold(engine: LLMEngine) -> None:
    deep: dict = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"], "additionalProperties": False}
    cases = {
        "deep": deep,
        "numbers": {"type": "array", "items": {"type": "number"}},  # unbounded repetition
        "empty": {},
    }
    params = {k: SamplingParams(max_tokens=96, temperature=0, structured_outputs=StructuredOutput(json=s)) for k, s in cases.items()}
    results = run_all(engine, {k: chat("JSON please.") for k in cases}, params)
    for name, schema in cases.items():
        if results[name]["final"].finish_reason == "stop":
            jsonschema.validate(json.loads(results[name]["text"]), schema)
    # A repetition of a repetition of a repetition (10^9 characters): llguidance's lexer is
    # lazy, so it compiles at once and the output is bounded by max_tokens.
    blowup = StructuredOutput(json={"type": "string", "pattern": "^[a-z]{1000}{1000}{1000}$"})
    out = run_all(engine, {"b": chat("x")}, SamplingParams(max_tokens=16, temperature=0, structured_outputs=blowup))
    assert out["b"]["final"].finish_reason == "length" and re.fullmatch(r'"[a-z]*', out["b"]["text"])


def test_a_repeated_schema_compiles_once_and_masks_are_cheap(engine: LLMEngine) -> None:
    schema = SCHEMAS[0][2]
    hits = engine.grammars.num_cache_hits
    for i in range(3):
        engine.make_request(f"r{i}", chat("x"), SamplingParams(structured_outputs=StructuredOutput(json=schema)))
    assert engine.grammars.num_cache_hits >= hits + 2
    assert len(engine.model_runner.token_masks.row_seconds) > 0  # masks were computed by the runs above


def test_constrained_and_unconstrained_rows_share_a_batch_and_speculation_skips_constrained(tmp_path: Path) -> None:
    from backends.default_model import default_model_path
    from core_engine.config import SpeculationConfig

    spec = make_engine(Path(default_model_path()), dtype="auto", weight_format="auto",
                       speculation=SpeculationConfig(methods=("ngram",)))
    text = chat("Count: one two three one two three one two three")
    params = {
        "free": SamplingParams(max_tokens=24, temperature=0),
        "bound": SamplingParams(max_tokens=24, temperature=0, structured_outputs=StructuredOutput(regex="(one |two |three )+")),
    }
    results = run_all(spec, {"free": text, "bound": text}, params)
    assert re.fullmatch("(one |two |three )+", results["bound"]["text"]) or results["bound"]["final"].finish_reason == "length"
    assert set(results["bound"]["text"].split()) <= {"one", "two", "three"}
    assert results["free"]["token_ids"]


def test_disable_any_whitespace_gives_compact_json(engine: LLMEngine) -> None:
    """vLLM's ``disable_any_whitespace``: no whitespace outside strings, so a sampled output
    cannot spend its tokens on newlines between items (which the default allows)."""
    schema = {"type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 2, "maxItems": 2}
    prompts = {f"s{seed}": chat("Two colours.") for seed in range(4)}
    params = {
        key: SamplingParams(
            max_tokens=40, temperature=1.0, seed=seed,
            structured_outputs=StructuredOutput(json=schema, disable_any_whitespace=True),
        )
        for seed, key in enumerate(prompts)
    }
    results = run_all(engine, prompts, params)
    for key, result in results.items():
        text = str(result["text"])
        assert result["final"].finish_reason == "stop", (key, text)
        assert json.dumps(json.loads(text), separators=(",", ":")) == text, (key, text)
    # The flag is part of the compiled grammar's identity (the cache keys differ).
    assert StructuredOutput(json=schema).key() != StructuredOutput(json=schema, disable_any_whitespace=True).key()
