"""Scheduler: continuous batching, chunked prefill budget, preemption (no tensors)."""

from edgecore.shared.models.config import EngineConfig
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.scheduler import Scheduler
from edgecore.shared.engine.sequence import Sequence, Status
from edgecore.shared.kv.block_manager import BlockManager


def seq(rid, n):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100))


def run_step(sched):
    batch = sched.schedule()
    sched.complete(batch)
    for s, _ in batch.items:     # every sequence that reached its end samples a token
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
    return batch


def test_chunked_prefill_respects_budget_and_decodes_join():
    sched = Scheduler(BlockManager(64, 4), EngineConfig(max_num_batched_tokens=10, max_num_seqs=8))
    a, b = seq("a", 3), seq("b", 25)
    sched.add(a)
    sched.add(b)
    batch = run_step(sched)
    assert [(s.request_id, n) for s, n in batch.items] == [("a", 3), ("b", 7)]
    batch = run_step(sched)      # a decodes 1 token, b continues its prefill with 9
    assert [(s.request_id, n) for s, n in batch.items] == [("a", 1), ("b", 9)]
    batch = run_step(sched)
    assert [(s.request_id, n) for s, n in batch.items] == [("a", 1), ("b", 9)]
    assert b.num_computed_tokens == 25 and b.num_tokens == 26


def test_new_request_joins_running_batch_between_steps():
    sched = Scheduler(BlockManager(64, 4), EngineConfig(max_num_batched_tokens=64))
    a = seq("a", 5)
    sched.add(a)
    run_step(sched)
    c = seq("c", 4)
    sched.add(c)
    batch = run_step(sched)
    assert [(s.request_id, n) for s, n in batch.items] == [("a", 1), ("c", 4)]


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, 4), EngineConfig(max_num_batched_tokens=100, max_num_seqs=2))
    for i in range(3):
        sched.add(seq(str(i), 2))
    batch = run_step(sched)
    assert len(batch.items) == 2 and len(sched.waiting) == 1


def test_preemption_frees_newest_and_requeues_it_first():
    sched = Scheduler(BlockManager(4, 4), EngineConfig(max_num_batched_tokens=100))
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)                       # 2 blocks each: pool full
    batch = run_step(sched)               # a needs a 3rd block → b preempted
    assert batch.preempted == [b]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and not b.table.blocks
    assert sched.waiting[0] is b
    assert [(s.request_id, n) for s, n in batch.items] == [("a", 1)]


def test_finish_frees_blocks():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, EngineConfig())
    a = seq("a", 6)
    sched.add(a)
    run_step(sched)
    assert bm.num_used == 2
    sched.finish(a, "stop")
    assert bm.num_used == 0 and a.status is Status.FINISHED and not sched.running


def test_interactive_requests_are_admitted_before_queued_batch_work():
    sched = Scheduler(BlockManager(64, 4), EngineConfig(max_num_batched_tokens=8, max_num_seqs=8))
    batch = [Sequence(f"b{i}", [1, 2, 3, 4], SamplingParams(), priority=1) for i in range(3)]
    for s in batch:
        sched.add(s)
    urgent = Sequence("edge", [5, 6, 7, 8], SamplingParams(), priority=0)
    sched.add(urgent)
    assert [s.request_id for s in sched.waiting] == ["edge", "b0", "b1", "b2"]
    step = run_step(sched)
    assert [s.request_id for s, _ in step.items] == ["edge", "b0"]
