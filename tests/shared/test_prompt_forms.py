"""A list of token ids is one prompt however long; the prompt-count limit applies to lists of prompts."""

import pytest

from edgecore.shared.openai.request import ApiError, parse_completion
from edgecore.shared.openai.schemas import MAX_PROMPTS


def test_long_token_id_prompt_is_one_prompt(tokenizer):
    parsed = parse_completion({"prompt": [5] * 500, "max_tokens": 4}, tokenizer, 2048, 2048)
    assert len(parsed.prompts) == 1 and len(parsed.prompts[0]) == 500


def test_too_many_prompts_names_prompt(tokenizer):
    with pytest.raises(ApiError) as exc:
        parse_completion({"prompt": [[5, 6]] * (MAX_PROMPTS + 1), "max_tokens": 4}, tokenizer, 2048, 2048)
    assert exc.value.param == "prompt" and exc.value.status == 400
