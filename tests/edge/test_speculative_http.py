"""Speculative decoding behind the edge's OpenAI API (the engine across the frontend ↔ engine-process link, as
in test_cache_salt_http.py): streamed and whole completions, several choices, equal the plain engine's text,
and /metrics counts the drafted and accepted tokens."""

from __future__ import annotations

import json

import pytest

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.config import SpeculativeConfig
from tests.conftest import make_engine
from tests.edge.edge_api import edge_api

pytestmark = pytest.mark.timeout(120)

PROMPT = ("def area(width, height):\n    return width * height\n\n\ndef area(width, height):\n"
          "    return width * height\n\n\ndef area(")


@pytest.fixture
async def api(model_dir):
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    async with edge_api(model_dir, make_engine(num_blocks=256, speculative=spec)) as session:
        yield session


async def complete(session, stream: bool, **body) -> list[str]:
    body = {"prompt": PROMPT, "max_tokens": 40, "stream": stream, **body}
    async with session.post("/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            return [c["text"] for c in sorted((await resp.json())["choices"], key=lambda c: c["index"])]
        texts: dict[int, str] = {}
        for line in (await resp.text()).splitlines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        return [texts[i] for i in sorted(texts)]


async def test_completions_equal_plain_decoding_and_drafts_are_counted(api):
    plain = make_engine()
    greedy = plain.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))[0]["text"]
    seeded = [plain.generate([PROMPT], SamplingParams(temperature=0.8, seed=5 + j, max_tokens=40))[0]["text"]
              for j in range(2)]
    for stream in (False, True):
        assert await complete(api, stream, temperature=0) == [greedy]
        assert await complete(api, stream, temperature=0.8, seed=5, n=2) == seeded
    async with api.get("/metrics") as resp:
        text = await resp.text()
    counts = {name: float(line.split()[-1]) for line in text.splitlines() if line.startswith("edgecore:spec_decode")
              for name in [line.split("{")[0]]}
    assert counts["edgecore:spec_decode_num_accepted_tokens_total"] > 0
    assert counts["edgecore:spec_decode_num_draft_tokens_total"] >= counts["edgecore:spec_decode_num_accepted_tokens_total"]
