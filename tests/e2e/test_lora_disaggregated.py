"""LoRA adapters on the disaggregated path: an in-process edge and core over a real socket. The core prefills
(and with decode handover decodes the first tokens) with the adapter the edge's PrefillRequest names; the
output equals transformers + peft (greedy, float32) for the base and each adapter, requests of different
adapters in flight together; an adapter the core lacks, or holds with other weights under the same name
(fingerprint), is refused by the core and the edge prefills locally, with the same output; a core that does not
advertise the "lora" capability (an older one) is never sent an adapter request."""

from __future__ import annotations

import asyncio

import pytest

from edgecore.core.server import CoreConfig, CoreServer
from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.protocol import messages as m
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.shared import lora_checkpoints

pytestmark = pytest.mark.timeout(180)
PROMPT = [(7 * i + 3) % 2000 for i in range(40)]      # more than two blocks: a cached prefix is skipped
N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    return lora_checkpoints.build(tmp_path_factory.mktemp("lora-disagg"))


@pytest.fixture(scope="module")
def expected(root):
    return {name: lora_checkpoints.reference(root, name, PROMPT, N) for name in (None, "attn", "mlp", "all")}


@pytest.fixture
async def pair(root, tmp_path):
    async for both in _pair(root, tmp_path):
        yield both


@pytest.fixture
async def older_core_pair(root, tmp_path, monkeypatch):
    """The same, its core from before LoRA: its AuthOk lacks "lora" (it would drop a PrefillRequest's adapter)."""
    monkeypatch.setattr(m, "CAPABILITIES", (m.COMPACT_KV_PARAMS,))
    async for both in _pair(root, tmp_path):
        yield both


async def _pair(root, tmp_path):
    core = CoreServer(CoreConfig(str(root / "base"), b"s", port=0, http_port=None, data_dir=str(tmp_path),
                                 dtype="fp32", loras=[("attn", str(root / "attn")), ("all", str(root / "all")),
                                                      ("same-name", str(root / "all"))]))
    await core.start()
    edge = EdgeNode(EdgeConfig(str(root / "base"), cores=[("127.0.0.1", core.port)], secret=b"s",
                                 local_prefill_below=0, max_core_attempts=1,
                                 loras=[("attn", str(root / "attn")), ("all", str(root / "all")),
                                        ("mlp", str(root / "mlp")), ("same-name", str(root / "attn"))]),
                      engine=make_engine(root / "base", num_blocks=128))
    await edge.start()
    yield core, edge
    await edge.stop()
    await core.stop()


async def run(edge: EdgeNode, rid: str, adapter: str | None) -> list[int]:
    tokens: list[int] = []
    async for out in edge.generate(rid, PROMPT, GREEDY, adapter=adapter):
        tokens += out.new_token_ids
    return tokens


async def test_core_prefills_with_the_adapter(pair, expected):
    core, edge = pair
    failovers = edge.metrics.failovers._value.get()
    names = [None, "attn", "all", "attn", None, "all"]
    got = await asyncio.gather(*(run(edge, f"r{i}", n) for i, n in enumerate(names)))
    assert got == [expected[n] for n in names]
    assert edge.metrics.failovers._value.get() == failovers              # every one prefilled at the core
    assert core.metrics.prefill_requests.labels("ok")._value.get() == len(names)
    # the same prompt again: its cached prefix at the edge is per adapter (skip_tokens under its salt)
    assert await run(edge, "again", "attn") == expected["attn"]
    assert await run(edge, "again-base", None) == expected[None]
    assert core.metrics.prefill_requests.labels("rejected")._value.get() == 0


async def test_adapter_missing_or_different_at_the_core_falls_back(pair, expected):
    _, edge = pair
    failovers = edge.metrics.failovers._value.get()
    assert await run(edge, "m", "mlp") == expected["mlp"]                 # the core has no 'mlp'
    assert edge.metrics.failovers._value.get() == failovers + 1
    assert await run(edge, "s", "same-name") == expected["attn"]          # the core's 'same-name' is other weights
    assert edge.metrics.failovers._value.get() == failovers + 2


async def test_a_core_without_the_lora_capability_gets_no_adapter_request(older_core_pair, expected):
    core, edge = older_core_pair
    assert await run(edge, "a", "attn") == expected["attn"]              # prefilled here: the core never sees it
    assert edge.metrics.local_prefills.labels("no_lora_core")._value.get() == 1
    assert core.metrics.prefill_requests.labels("ok")._value.get() == 0
    assert await run(edge, "b", None) == expected[None]                  # the base model still goes to the core
    assert core.metrics.prefill_requests.labels("ok")._value.get() == 1
