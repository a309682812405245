"""Scheduler fairness between requests (groups): a big request cannot starve small ones (CPU, no tensors)."""

import itertools

from edgecore.shared.models.config import EngineConfig
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.scheduler import Scheduler
from edgecore.shared.engine.sequence import Sequence, Status
from edgecore.shared.kv.block_manager import BlockManager


_prompts = itertools.count()


def seq(rid, n, priority=0, group=None):
    """A sequence with a prompt of its own (no prefix shared with any other: no cache hits); `GROUP-i` declares
    the group GROUP (as the edge declares an HTTP request's choices) unless `group` is given."""
    start = next(_prompts) * 1000 + 1
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=100), priority=priority,
                    group=rid.rpartition("-")[0] if group is None else group)


def step(sched, max_output: int | None = None):
    """One step; every sequence that reached its end samples a token; with `max_output`, finishes those
    that have that many output tokens."""
    batch = sched.schedule()
    sched.complete(batch)
    for s, _ in batch.items:
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
            if max_output is not None and s.num_output_tokens >= max_output:
                sched.finish(s, "length")
    return batch


def test_groups_are_declared_never_read_from_ids():
    params = SamplingParams(max_tokens=1)
    assert Sequence("chatcmpl-abc-0", [1], params).group == "chatcmpl-abc-0"     # undeclared: a group alone
    assert Sequence("chatcmpl-abc-0", [1], params, group="g").group == "g"
    sched = Scheduler(BlockManager(256, 4), EngineConfig(max_num_batched_tokens=64, max_num_seqs=8))
    renamed = [seq(f"x{i}", 40, group="one") for i in range(2)] + [seq("y", 40, group="two")]
    for s in renamed:
        sched.add(s)
    batch = step(sched)         # two groups share 64 tokens: 32 each, whatever the ids look like
    assert dict((s.request_id, n) for s, n in batch.items) == {"x0": 32, "y": 32}


def test_small_request_takes_the_first_free_slot_while_a_big_one_runs():
    sched = Scheduler(BlockManager(256, 4), EngineConfig(max_num_batched_tokens=64, max_num_seqs=4))
    big = [seq(f"big-{i}", 8) for i in range(16)]
    for s in big:
        sched.add(s)
    step(sched)
    assert [s.request_id for s in sched.running] == ["big-0", "big-1", "big-2", "big-3"]
    small = seq("small-0", 5)
    sched.add(small)                          # queued behind 12 waiting sequences of the big request
    step(sched)
    assert small.status is Status.WAITING     # every slot is taken
    sched.finish(big[0], "stop")
    batch = step(sched)
    assert small.status is Status.RUNNING and (small, 5) in batch.items     # not big-4, which came first
    assert big[4].status is Status.WAITING


def test_small_request_finishes_before_the_big_ones_second_wave():
    """FCFS would serve the small request after all 32 sequences of the big one (4 waves)."""
    sched = Scheduler(BlockManager(1024, 4), EngineConfig(max_num_batched_tokens=32, max_num_seqs=8))
    big = [seq(f"big-{i}", 16) for i in range(32)]
    for s in big:
        sched.add(s)
    small = None
    for n in range(200):
        if n == 3:
            small = seq("small-0", 4)
            sched.add(small)
        step(sched, max_output=20)
        if small is not None and small.status is not Status.WAITING:
            break
    admitted = sum(1 for s in big if s.status is not Status.WAITING)
    assert small.status is Status.RUNNING and admitted <= 8      # admitted ahead of the rest of the big request
    for _ in range(30):
        step(sched, max_output=20)
    assert small.status is Status.FINISHED


def test_prefill_budget_is_shared_between_requests_and_fully_used():
    sched = Scheduler(BlockManager(512, 4), EngineConfig(max_num_batched_tokens=64, max_num_seqs=16))
    big = [seq(f"big-{i}", 200) for i in range(4)]
    for s in big:
        sched.add(s)
    batch = step(sched)
    assert sum(n for _, n in batch.items) == 64 and big[0].num_computed_tokens == 64   # alone: the whole budget
    small = seq("small-0", 10)
    sched.add(small)
    batch = step(sched)
    tokens = {s.request_id: n for s, n in batch.items}
    assert tokens["small-0"] == 10                            # its whole prompt at once, not after the big prefills
    assert sum(tokens.values()) == 64                         # the big request takes what the small one left
    assert small.num_computed_tokens == 10


def test_two_big_requests_are_admitted_round_robin():
    sched = Scheduler(BlockManager(256, 4), EngineConfig(max_num_batched_tokens=256, max_num_seqs=6))
    for i in range(6):
        sched.add(seq(f"a-{i}", 4))
    for i in range(6):
        sched.add(seq(f"b-{i}", 4))
    step(sched)
    assert sorted(s.request_id for s in sched.running) == ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2"]


def test_priority_still_comes_before_fairness():
    sched = Scheduler(BlockManager(256, 4), EngineConfig(max_num_batched_tokens=256, max_num_seqs=2))
    for i in range(3):
        sched.add(seq(f"batch{i}-0", 4, priority=1))
    sched.add(seq("edge-0", 4))
    sched.add(seq("edge-1", 4))
    step(sched)
    assert sorted(s.request_id for s in sched.running) == ["edge-0", "edge-1"]


def test_preemption_takes_from_the_request_holding_the_most():
    # 9 blocks of 4 tokens; prompts of 7 tokens: 2 blocks each until their 9th token.
    sched = Scheduler(BlockManager(9, 4), EngineConfig(max_num_batched_tokens=100, max_num_seqs=8))
    big = [seq(f"big-{i}", 7) for i in range(3)]
    small = seq("small-0", 7)
    for s in big:
        sched.add(s)
    step(sched)
    sched.add(small)
    step(sched)
    assert small.status is Status.RUNNING and sched.bm.num_free == 1
    batch = step(sched)                      # everyone needs a 3rd block: one is free
    assert batch.preempted == [big[2]]       # the newest of the biggest request, not the newer small one
    assert small.status is Status.RUNNING and small in [s for s, _ in batch.items]
