"""Prefix-aware routing: the core with the least predicted time to first token for this prompt (its RTT, its queue,
the prompt tokens its prefix cache lacks), and the edge's own prediction against it. No sockets."""

from dataclasses import dataclass, field

from edgecore.shared.node.cache_digest import frames
from edgecore.edge.core_cache import CoreCache
from edgecore.edge.core_choice import CoreChoice
from edgecore.edge.placement import PrefillModel
from edgecore.shared.kv.block_manager import prefix_hashes
from edgecore.shared.models.lora import scope_salt


@dataclass
class FakeCore:
    address: str
    rtt: float
    load: int = 0
    healthy: bool = True
    cache: CoreCache = field(default_factory=CoreCache)

    def holds(self, prompt, salt=None, queued=0):
        self.cache.apply(frames(16, prefix_hashes(prompt, 16, salt=salt), [], True, queued)[0])
        return self


def measured(ms_per_token_core=0.5, ms_per_token_edge=2.0) -> PrefillModel:
    model = PrefillModel(explore_every=1000)
    for core in ("near", "far"):
        model.observe_remote(core, 1000, 1000 * ms_per_token_core / 1e3, 0.0)
    model.observe_local(1000, 1000 * ms_per_token_edge / 1e3)
    return model


PROMPT = list(range(1000, 1800))          # 800 tokens


def test_the_core_holding_the_prefix_wins_over_a_nearer_one():
    near, far = FakeCore("near", 0.010), FakeCore("far", 0.080).holds(PROMPT[:640])
    choice = CoreChoice([near, far], PROMPT, None, measured())
    best = choice.best()
    assert best.address == "far" and best.cached == 640 and best.uncached == 160
    assert abs(best.seconds - (0.080 + 160 * 0.5e-3)) < 1e-9
    assert choice.predictions[1].seconds == 0.010 + 800 * 0.5e-3
    # A retry skips the core that failed; an unhealthy core is never offered.
    assert choice.best({"far"}).address == "near"
    near.healthy = False
    assert choice.best({"far"}) is None
    assert "core far 0.160 s (640 cached)" in choice.describe()


def test_a_short_prefix_does_not_pay_a_long_round_trip_and_the_queue_counts():
    near, far = FakeCore("near", 0.010), FakeCore("far", 0.200).holds(PROMPT[:64])
    assert CoreChoice([near, far], PROMPT, None, measured()).best().address == "near"
    # The near core is busy: 2000 prompt tokens queued (1 s of work) outweigh the far core's round trip.
    near.holds([], queued=2000)
    choice = CoreChoice([near, far], PROMPT, None, measured())
    assert choice.best().address == "far"
    # What this edge sends counts until the core's next digest.
    near.cache.queued_tokens = 0
    picks = []
    for _ in range(3):
        choice = CoreChoice([near, far], PROMPT, None, measured())
        pick = choice.best()
        choice.sent(pick)
        picks.append(pick.address)
    assert picks == ["near", "far", "near"], picks


def test_a_prefix_under_another_salt_or_adapter_is_not_a_hit():
    far = FakeCore("far", 0.080).holds(PROMPT[:640], salt="tenant-a")
    near = FakeCore("near", 0.010)
    assert CoreChoice([near, far], PROMPT, "tenant-a", measured()).best().address == "far"
    assert CoreChoice([near, far], PROMPT, "tenant-b", measured()).best().address == "near"
    lora = scope_salt(None, "sql", "0123456789abcdef")
    far.holds(PROMPT[:640], salt=lora)
    assert CoreChoice([near, far], PROMPT, lora, measured()).best().cached == 640
    assert CoreChoice([near, far], PROMPT, scope_salt(None, "sql", "fedcba9876543210"), measured()).best().cached == 0


def test_a_core_without_digests_is_ranked_by_round_trip_and_requests_in_flight():
    quiet, busy = FakeCore("a", 0.02), FakeCore("b", 0.01, load=3)
    choice = CoreChoice([quiet, busy], PROMPT, None, PrefillModel())
    assert [p.address for p in choice.predictions] == ["a", "b"]      # nothing measured: the prior rate
    assert choice.predictions[1].seconds == 0.01 + 4 * 800 * 1e-3


def test_the_edge_competes_with_its_own_cached_prefix_and_queue():
    model = measured()
    far = FakeCore("far", 0.080)
    best = CoreChoice([far], PROMPT, None, model).best()            # 0.48 s at the core
    assert model.local_is_faster(100, "far", best.seconds)            # 100 uncached here: 0.2 s
    assert not model.local_is_faster(100, "far", best.seconds, queue=400)   # behind 400 queued tokens: 1 s
    assert not model.local_is_faster(800, "far", best.seconds)


def test_core_routing_rtt_reads_no_digest():
    near, far = FakeCore("near", 0.010), FakeCore("far", 0.080).holds(PROMPT[:640])
    choice = CoreChoice([near, far], PROMPT, None, measured(), digests=False)
    assert choice.best().address == "near" and all(p.cached == 0 for p in choice.predictions)
