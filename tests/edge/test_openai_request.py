"""OpenAI request bodies → ParsedRequest: schema errors name the parameter, sampling fields reach the engine."""

import pytest

from edgecore.shared.openai.request import ApiError, parse_chat, parse_completion
from edgecore.shared.openai.response import ChoiceResult, TokenText, response_body
from edgecore.shared.engine.output import TokenLogprob

VOCAB, CTX = 2048, 1024
CHAT = [{"role": "user", "content": "Hi"}]


def chat(tokenizer, **kw):
    return parse_chat({"messages": CHAT, **kw}, tokenizer, VOCAB, CTX)


def comp(tokenizer, **kw):
    return parse_completion({"prompt": "The class", **kw}, tokenizer, VOCAB, CTX)


def rejected(fn, tokenizer, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(tokenizer, **kw)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("kw, param, code", [
    ({"n": True}, "n", "invalid_type"),
    ({"stop_token_ids": 5}, "stop_token_ids", "invalid_type"),
    ({"stop_token_ids": [2 ** 70]}, "stop_token_ids[0]", "invalid_value"),
    ({"top_k": 1e30}, "top_k", "invalid_type"),
    ({"top_k": 2 ** 70}, "top_k", "invalid_value"),
    ({"seed": 2 ** 64}, "seed", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"min_p": 5}, "min_p", "invalid_value"),
    ({"presence_penalty": 3}, "presence_penalty", "invalid_value"),
    ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty", "invalid_value"),   # 1/r overflows float32
    ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "invalid_type"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]",
     "unsupported_parameter"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),   # without stream
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "unsupported_parameter"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "unsupported_parameter"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_value"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_type"),
])
def test_chat_errors_name_the_parameter(tokenizer, kw, param, code):
    err = rejected(chat, tokenizer, **kw)
    assert (err.param, err.code) == (param, code)
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
    ("use_beam_search", True), ("min_tokens", 3), ("functions", [{"name": "f"}]),
    ("include_stop_str_in_output", True), ("skip_special_tokens", False), ("spaces_between_special_tokens", False),
    ("truncate_prompt_tokens", 8), ("bad_words", ["x"]), ("allowed_token_ids", [1, 2]), ("length_penalty", 0.5),
    ("early_stopping", True), ("logits_processors", ["x"]), ("return_tokens_as_token_ids", True), ("priority", 1),
    ("best_of", 2), ("echo", True), ("chat_template", "{{ 1 }}"),
    ("add_generation_prompt", False), ("continue_final_message", True), ("documents", [{"text": "x"}]),
])
def test_known_but_unsupported_parameters_are_400(tokenizer, field, value):
    assert rejected(chat, tokenizer, **{field: value}).param == field


@pytest.mark.parametrize("field, value", [("include_stop_str_in_output", True), ("add_special_tokens", False),
                                          ("skip_special_tokens", False), ("priority", -1)])
def test_vllm_extras_this_server_does_not_implement_are_400_on_completions(tokenizer, field, value):
    assert rejected(comp, tokenizer, **{field: value}).param == field


def test_defaults_of_unsupported_parameters_and_unknown_fields_are_accepted(tokenizer):
    parsed = chat(tokenizer, response_format={"type": "text"}, tool_choice="none", tools=[], foo={"bar": 1},
                  parallel_tool_calls=False, user="me")
    assert len(parsed.params) == 1
    assert rejected(comp, tokenizer, suffix="x").param == "suffix"
    assert comp(tokenizer, suffix="").params
    assert chat(tokenizer, include_stop_str_in_output=False, skip_special_tokens=True, add_generation_prompt=True,
                echo=False, best_of=1, priority=0).params         # the defaults, as this server behaves
    assert comp(tokenizer, best_of=2, echo=True, add_special_tokens=True).params


def test_sampling_fields_reach_the_params(tokenizer):
    p = comp(tokenizer, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3, min_p=0.1,
             logit_bias={"7": -100, "9": 2.5}, temperature=0.7, top_k=5, seed=3, stop_token_ids=[4]).params[0]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -0.25, 1.3, 0.1)
    assert p.logit_bias == {7: -100.0, 9: 2.5} and p.adjusts_logits
    assert (p.temperature, p.top_k, p.seed, p.stop_token_ids) == (0.7, 5, 3, [4])
    assert not comp(tokenizer).params[0].adjusts_logits


def test_best_of(tokenizer):
    parsed = comp(tokenizer, n=2, best_of=4, temperature=1.0)
    assert parsed.n == 4 and parsed.returned == 2 and len(parsed.params) == 4
    assert all(p.logprobs == 0 for p in parsed.params) and parsed.logprobs is None   # ranked, not shown
    assert rejected(comp, tokenizer, n=3, best_of=2).param == "best_of"
    assert rejected(comp, tokenizer, n=1, best_of=2, stream=True).param == "best_of"
    results = []
    for cum in (-5.0, -1.0, -3.0, -0.5):
        r = ChoiceResult(text=str(cum), tokens=1, finish_reason="length")
        r.logprobs = [TokenLogprob(1, cum)]
        results.append(r)
    body = response_body(parsed, results, False, "id", 0, "m", TokenText(tokenizer))
    assert [c["text"] for c in body["choices"]] == ["-0.5", "-1.0"] and body["usage"]["completion_tokens"] == 4
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["choices"][0]["logprobs"] is None


def test_prompt_forms(tokenizer):
    assert len(parse_completion({"prompt": ["a", "b"]}, tokenizer, VOCAB, CTX).prompts) == 2
    assert parse_completion({"prompt": [[5, 6], [7]]}, tokenizer, VOCAB, CTX).prompts == [[5, 6], [7]]
    assert parse_completion({"prompt": [5, 6]}, tokenizer, VOCAB, CTX).prompts == [[5, 6]]
    for prompt in ([5, "a"], [], [[]], [VOCAB], 5, None):
        with pytest.raises(ApiError) as e:
            parse_completion({"prompt": prompt}, tokenizer, VOCAB, CTX)
        assert e.value.status == 400 and e.value.param.startswith("prompt")


def test_echo_logprobs_and_prompt_logprobs_bodies(tokenizer):
    parsed = comp(tokenizer, echo=True, logprobs=1, max_tokens=1)
    assert parsed.prompt_logprobs == 1 and parsed.params[0].prompt_logprobs == 1
    assert rejected(comp, tokenizer, echo=True, logprobs=1, stream=True).param == "echo"
    ids = parsed.prompts[0]
    r = ChoiceResult(text="X", tokens=1, finish_reason="length")
    r.logprobs = [TokenLogprob(88, -0.25, [(88, -0.25)])]
    r.prompt_logprobs = [None] + [TokenLogprob(t, -1.0 - i, [(t, -1.0 - i)], 1) for i, t in enumerate(ids[1:])]
    texts = TokenText(tokenizer)
    lp = response_body(parsed, [r], False, "id", 0, "m", texts)["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-1.0 - i for i in range(len(ids) - 1)] + [-0.25]
    assert "".join(lp["tokens"][:-1]) == tokenizer.decode(ids[1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len("".join(lp["tokens"][:-1]))
    chat_parsed = chat(tokenizer, prompt_logprobs=0, max_tokens=1)
    assert rejected(chat, tokenizer, prompt_logprobs=0, stream=True).param == "prompt_logprobs"
    r.prompt_logprobs = [None, TokenLogprob(5, -2.0, [], 7)]
    body = response_body(chat_parsed, [r], True, "id", 0, "m", texts)
    assert body["prompt_logprobs"] == [None, {"5": {"logprob": -2.0, "rank": 7, "decoded_token": texts.text(5)}}]


def template_variables(tokenizer, monkeypatch) -> dict:
    """The extra variables the chat template receives from now on (filled as requests are parsed)."""
    seen = {}
    render = tokenizer.apply_chat_template

    def recording(messages, add_generation_prompt=True, tools=None, **extra):
        seen.update(extra)
        return render(messages, add_generation_prompt, tools=tools, **extra)

    monkeypatch.setattr(tokenizer, "apply_chat_template", recording)
    return seen


def test_chat_template_kwargs_reach_the_template(tokenizer, monkeypatch):
    seen = template_variables(tokenizer, monkeypatch)
    assert chat(tokenizer, chat_template_kwargs={"enable_thinking": False}).params
    assert seen == {"enable_thinking": False}
    for bad in ({"messages": []}, {"bos_token": "x"}, {"not an identifier": 1}, {"_private": 1},
                {"namespace": 1}, {"range": "x"}):          # Jinja's globals, which templates call
        assert rejected(chat, tokenizer, chat_template_kwargs=bad).param == "chat_template_kwargs"


def test_a_template_that_raises_on_its_input_is_a_400(tokenizer, monkeypatch):
    """A template's own code failing on a value it did not expect (here a number where it does string
    arithmetic) is the request's fault: a 400, not a 500."""
    monkeypatch.setattr(tokenizer, "chat_template", "{{ messages[0]['content'] ~ (flag + 1) }}")
    monkeypatch.setattr(tokenizer, "_template", None)
    assert rejected(chat, tokenizer, chat_template_kwargs={"flag": "text"}).param == "messages"


def test_null_n_is_one_and_reasoning_effort_reaches_the_template(tokenizer, monkeypatch):
    """The openai client sends `n: null` for n=None; `reasoning_effort` is a template variable (as vLLM passes it:
    gpt-oss's templates read it)."""
    assert chat(tokenizer, n=None).n == 1 and comp(tokenizer, n=None).n == 1
    seen = template_variables(tokenizer, monkeypatch)
    chat(tokenizer, reasoning_effort="low")
    assert seen == {"reasoning_effort": "low"}
