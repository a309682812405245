"""Pipeline micro-batches: every sequence once, order kept within a group, token counts balanced."""

from edgecore.shared.engine.parallel_runner import StageRunner
from edgecore.shared.models.parallel import Layout


class _Seq:
    pass


def split(items, pp, micro):
    runner = StageRunner.__new__(StageRunner)       # only the splitting logic is exercised
    runner.layout = Layout(tp=1, pp=pp, rank=0, split=(1,) * pp, micro_batches=micro)
    return runner.micro_batches(items)


def test_micro_batches_cover_each_sequence_once_and_balance_tokens():
    items = [(_Seq(), n) for n in (512, 1, 1, 300, 200, 1, 40)]
    groups = split(items, pp=2, micro=2)
    assert len(groups) == 2
    flat = [id(s) for g in groups for s, _ in g]
    assert sorted(flat) == sorted(id(s) for s, _ in items)
    loads = [sum(n for _, n in g) for g in groups]
    assert max(loads) - min(loads) <= 512 - 300 + 40
    position = {id(s): i for i, (s, _) in enumerate(items)}
    for g in groups:
        assert [position[id(s)] for s, _ in g] == sorted(position[id(s)] for s, _ in g)


def test_single_stage_or_single_item_is_one_batch():
    items = [(_Seq(), 5), (_Seq(), 7)]
    assert len(split(items, pp=1, micro=4)) == 1
    assert len(split(items[:1], pp=2, micro=2)) == 1
