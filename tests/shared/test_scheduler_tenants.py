"""Tenants in the scheduler: the step budget and sequence slots shared by weight between tenants, then between
each tenant's request groups; priority bands strict (CPU, no tensors, fake sequences)."""

import itertools
from collections import Counter

import pytest

from edgecore.shared.models.config import EngineConfig
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.scheduler import Scheduler
from edgecore.shared.engine.sequence import Sequence, Status
from edgecore.shared.kv.block_manager import BlockManager
from edgecore.shared.node.tenants import Tenant

_prompts = itertools.count()


def seq(rid, n, tenant, weight=1.0, priority=0, group=None, max_tokens=4):
    start = next(_prompts) * 10_000 + 1
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), priority=priority,
                    group=group or rid, tenant=tenant, weight=weight)


def run(sched, steps, feed=None):
    """`steps` steps; tokens computed per tenant; `feed(sched)` tops the queues up before each step; a
    sequence at its end samples a token and finishes at its max_tokens."""
    tokens: Counter[str] = Counter()
    for _ in range(steps):
        if feed is not None:
            feed(sched)
        batch = sched.schedule()
        sched.complete(batch)
        for s, n in batch.items:
            tokens[s.tenant] += n
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(7)
                if s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s, "length")
    return tokens


def prefilling(sched):
    """Requests per tenant with prompt tokens still to compute (waiting or running)."""
    return Counter(q.tenant for q in [*sched.running, *sched.waiting] if q.num_computed_tokens < q.num_prompt_tokens)


def saturate(sched, tenants, groups=3, prompt=300):
    """Keep `groups` long prompts to prefill for each tenant (name → weight, priority): it always wants more."""
    ids = itertools.count()

    def feed(s):
        present = prefilling(s)
        for name, (weight, priority) in tenants.items():
            for _ in range(groups - present[name]):
                s.add(seq(f"{name}-{next(ids)}", prompt, name, weight, priority))
    return feed


@pytest.mark.parametrize("weights, expected", [((1, 3), 0.25), ((1, 1), 0.5), ((2, 1), 2 / 3)])
def test_two_saturating_tenants_share_the_step_budget_by_weight(weights, expected):
    sched = Scheduler(BlockManager(4096, 16), EngineConfig(max_num_batched_tokens=256, max_num_seqs=16))
    tokens = run(sched, 300, saturate(sched, {"a": (weights[0], 0), "b": (weights[1], 0)}))
    share = tokens["a"] / (tokens["a"] + tokens["b"])
    assert abs(share - expected) < 0.03, (tokens, share)
    assert tokens["a"] + tokens["b"] >= 0.97 * 300 * 256          # and the steps stay full


def test_a_tenant_with_many_requests_gets_no_more_than_one_with_few():
    sched = Scheduler(BlockManager(4096, 16), EngineConfig(max_num_batched_tokens=256, max_num_seqs=16))
    ids = itertools.count()

    def feed(s):
        present = prefilling(s)
        for name, want in (("many", 12), ("few", 2)):
            for _ in range(want - present[name]):
                s.add(seq(f"{name}-{next(ids)}", 300, name))
    tokens = run(sched, 300, feed)
    assert abs(tokens["many"] / (tokens["many"] + tokens["few"]) - 0.5) < 0.03, tokens


def test_an_idle_tenants_share_goes_to_the_busy_one():
    sched = Scheduler(BlockManager(4096, 16), EngineConfig(max_num_batched_tokens=256, max_num_seqs=16))
    tokens = run(sched, 50, saturate(sched, {"a": (1, 0)}))
    sched.add(seq("b-0", 3, "b", weight=100))           # a tiny request of a heavy tenant, then nothing
    tokens += run(sched, 50, saturate(sched, {"a": (1, 0)}))
    assert tokens["b"] == 3 + 4 - 1 and tokens["a"] >= 0.97 * 100 * 256     # the steps stayed full


def test_sequence_slots_are_shared_by_weight():
    sched = Scheduler(BlockManager(4096, 16), EngineConfig(max_num_batched_tokens=4096, max_num_seqs=8))
    for i in range(10):
        sched.add(seq(f"a-{i}", 20, "a", weight=1))
    for i in range(10):
        sched.add(seq(f"b-{i}", 20, "b", weight=3))
    sched.schedule()
    assert Counter(s.tenant for s in sched.running) == {"a": 2, "b": 6}


def test_a_lower_band_is_served_strictly_first():
    a, b = Tenant(name="a", api_keys=["0" * 64], priority=0), Tenant(name="b", api_keys=["1" * 64], priority=1)
    sched = Scheduler(BlockManager(4096, 16), EngineConfig(max_num_batched_tokens=256, max_num_seqs=16))
    feed = saturate(sched, {"a": (1, a.engine_priority()), "b": (100, b.engine_priority())}, groups=2,
                    prompt=30_000)
    tokens = run(sched, 100, feed)
    assert tokens["b"] == 0 and tokens["a"] == 100 * 256          # whatever b's weight
    # b runs as soon as a's band has nothing left
    for s in [*sched.waiting, *sched.running]:
        if s.tenant == "a":
            sched.finish(s, "abort")
    tokens = run(sched, 10, saturate(sched, {"b": (1, b.engine_priority())}, prompt=30_000))
    assert tokens["b"] == 10 * 256


def test_a_less_urgent_running_prefill_waits_for_the_urgent_ones():
    sched = Scheduler(BlockManager(4096, 16), EngineConfig(max_num_batched_tokens=64, max_num_seqs=8))
    low = seq("low", 500, "b", priority=1000)
    sched.add(low)
    run(sched, 1)
    assert low.status is Status.RUNNING and low.num_computed_tokens == 64
    urgent = seq("urgent", 40, "a", priority=0)
    sched.add(urgent)
    batch = sched.schedule()
    got = {s.request_id: n for s, n in batch.items}
    assert got == {"urgent": 40, "low": 24}        # the urgent prompt whole, the running one only what is left


def test_request_priority_inside_a_band_orders_a_tenants_own_requests():
    t = Tenant(name="a", api_keys=["0" * 64], priority=2)
    sched = Scheduler(BlockManager(4096, 16), EngineConfig(max_num_batched_tokens=4096, max_num_seqs=1))
    later = seq("later", 8, "a", priority=t.engine_priority(5))
    sched.add(later)
    sooner = seq("sooner", 8, "a", priority=t.engine_priority(0))
    sched.add(sooner)
    sched.schedule()
    assert sched.running == [sooner]
    assert t.engine_priority(999) < Tenant(name="b", api_keys=["1" * 64], priority=3).engine_priority(0)


def test_preemption_takes_from_the_tenant_holding_the_most_for_its_weight():
    # 12 blocks of 4; prompts of 7 tokens hold 2 blocks until their 9th token
    sched = Scheduler(BlockManager(12, 4), EngineConfig(max_num_batched_tokens=1000, max_num_seqs=8))
    heavy = [seq(f"h-{i}", 7, "heavy", weight=4, max_tokens=50) for i in range(4)]
    light = [seq(f"l-{i}", 7, "light", weight=1, max_tokens=50) for i in range(2)]
    for s in light + heavy:
        sched.add(s)
    run(sched, 2)
    assert len(sched.running) == 6 and sched.bm.num_free == 0
    batch = sched.schedule()        # every one needs a 3rd block: the light tenant holds more for its weight
    assert batch.preempted[0].tenant == "light"
