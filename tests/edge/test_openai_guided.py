"""Structured output: request fields → GuidedSpec, grammar errors → 400, the engine's masked output matches."""

import json
import re

import pytest
import torch

from edgecore.shared.engine.grammar import Grammars, apply_masks
from edgecore.shared.engine.sampling_params import GuidedSpec, SamplingParams
from edgecore.shared.openai.request import ApiError, parse_chat, parse_completion
from tests.conftest import make_engine

VOCAB, CTX = 2048, 1024
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["a", "b"]}},
          "required": ["name", "n", "kind"], "additionalProperties": False}


def chat(tokenizer, **kw):
    return parse_chat({"messages": [{"role": "user", "content": "Hi"}], **kw}, tokenizer, VOCAB, CTX)


@pytest.mark.parametrize("kw, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema"),
    ({"guided_json": SCHEMA}, "json_schema"), ({"guided_json": json.dumps(SCHEMA)}, "json_schema"),
    ({"guided_regex": "[0-9]+"}, "regex"), ({"guided_choice": ["yes", "no"]}, "choice"),
    ({"guided_grammar": 'start: "a" | "b"'}, "lark"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),        # vLLM's newer form
    ({"structured_outputs": {"json": SCHEMA, "regex": None}}, "json_schema"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex"),
    ({"structured_outputs": {"json_object": True}}, "json_object"),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "lark"),
])
def test_fields_become_one_spec(tokenizer, kw, kind):
    params = chat(tokenizer, n=2, **kw).params
    assert all(p.guided is not None and p.guided.kind == kind for p in params)
    assert chat(tokenizer, response_format={"type": "text"}).params[0].guided is None


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format.json_schema.schema"),
    ({"guided_json": "{"}, "guided_json"), ({"guided_json": [1]}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"), ({"guided_regex": 5}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"), ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_json": {}}, "guided_regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": [1]}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs.regex"),
])
def test_bad_grammars_are_400_naming_the_field(tokenizer, kw, param):
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "x", **kw}, tokenizer, VOCAB, CTX)
    assert e.value.status == 400 and e.value.param == param


def test_mask_keeps_only_allowed_tokens(tokenizer):
    grammars = Grammars(tokenizer.backend.to_str(), VOCAB, (1,))
    m = grammars.matcher(GuidedSpec("choice", json.dumps(["yes", "no"])))
    logits = torch.zeros(3, VOCAB)
    out = apply_masks(logits, [m], [1])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    texts = {tokenizer.decode([t]) for t in allowed}
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in texts)


@pytest.fixture(scope="module")
def eng():
    return make_engine()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_output_follows_each_kind(eng, tokenizer, temperature):
    prompt = tokenizer.encode("The list type is")
    specs = {
        "schema": GuidedSpec("json_schema", json.dumps(SCHEMA)),
        "object": GuidedSpec("json_object"),
        "regex": GuidedSpec("regex", r"[0-9]{3}-[a-z]{2,5}"),
        "choice": GuidedSpec("choice", json.dumps(["alpha", "beta gamma", 'q"uote'])),
    }
    names = list(specs)
    params = [SamplingParams(max_tokens=120, temperature=temperature, seed=7, guided=specs[n]) for n in names]
    params.append(SamplingParams(max_tokens=8, temperature=0))      # an unguided row in the same batch
    out = dict(zip(names + ["free"], eng.generate([prompt] * 5, params)))
    schema = json.loads(out["schema"]["text"])
    assert set(schema) == {"name", "n", "kind"} and 0 <= schema["n"] <= 999 and schema["kind"] in "ab"
    assert len(schema["name"]) <= 24
    if out["object"]["finish_reason"] == "stop":
        assert isinstance(json.loads(out["object"]["text"]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", out["regex"]["text"])
    assert out["choice"]["text"] in ("alpha", "beta gamma", 'q"uote')
    assert all(out[n]["finish_reason"] == "stop" for n in ("schema", "regex", "choice"))
    free = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out["free"]["token_ids"] == free["token_ids"]        # the masks touch only their own rows


@pytest.mark.parametrize("spec", [GuidedSpec("regex", r"[^\s\S]", "guided_regex"),
                                  GuidedSpec("json_schema", json.dumps({"$ref": "#"}), "guided_json")])
def test_a_grammar_whose_language_is_empty_is_refused(tokenizer, spec):
    from edgecore.shared.errors import RequestError
    grammars = Grammars(tokenizer.backend.to_str(), VOCAB, (1,))
    with pytest.raises(RequestError, match="matches no text") as e:
        grammars.matcher(spec)
    assert e.value.param == spec.param
    assert grammars.matcher(GuidedSpec("regex", "", "guided_regex")) is not None     # only "": fine


def test_objects_with_properties_are_closed_unless_the_schema_says_otherwise():
    """vLLM's default backend and OpenAI's strict mode: no keys beyond `properties` unless the schema asks for
    them; subschemas are walked (a property named like a keyword is a name, not a schema)."""
    from edgecore.shared.engine.grammar import closed_objects
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "list": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/p"}, {"type": "null"}]}}},
        "$defs": {"p": {"type": "object", "patternProperties": {"^a": {"type": "string"}}}},
        "const": {"properties": 1}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in out["properties"]
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["$defs"]["p"]["additionalProperties"] is False
    assert out["const"] == {"properties": 1} and "additionalProperties" not in schema      # a copy
    assert closed_objects({"type": "object"}) == {"type": "object"}                         # json_object: any


def test_a_closed_object_takes_no_extra_key(tokenizer):
    """After `{"a":1` the only ways on are `}` (closed) — or also `,` when the schema leaves it open."""
    grammars = Grammars(tokenizer.backend.to_str(), VOCAB, (1,))

    def next_texts(schema):
        m = grammars.matcher(GuidedSpec("json_schema", json.dumps(schema)))
        for t in tokenizer.encode('{"a":1')[1:]:         # after the BOS
            m.consume_token(t)
        out = apply_masks(torch.zeros(1, VOCAB), [m], [0])
        return {tokenizer.decode([t])[:1] for t in torch.isfinite(out[0]).nonzero().flatten().tolist()}
    closed = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 1}}, "required": ["a"]}
    assert next_texts(closed) == {"}"}
    assert "," in next_texts({**closed, "additionalProperties": True})
