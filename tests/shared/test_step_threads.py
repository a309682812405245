"""StepThreads: small steps alternate between one thread and all while timed, then keep the faster, and
time again later; the choice can be pinned; the engine reports its steps' times to it."""

import pytest

from edgecore.shared.engine.step_threads import StepThreads
from edgecore.shared.errors import ConfigError


@pytest.fixture
def timed(monkeypatch):
    monkeypatch.delenv("EDGECORE_SMALL_STEP_THREADS", raising=False)


DECODE4, DECODE1, PREFILL4 = (4, True), (1, True), (4, False)


def drive(chooser, kind, cost, steps):
    """Run `steps` steps of `kind` whose wall time is cost(one_thread), in ModelRunner.run's order of calls;
    returns the choices made."""
    made = []
    for _ in range(steps):
        one = chooser.one_thread(kind)
        made.append(one)
        if chooser.timing(kind):
            chooser.record(kind, one, cost(one))
    return made


def test_the_faster_setting_is_kept_then_timed_again(timed):
    chooser = StepThreads(16, samples=3, keep=10)
    made = drive(chooser, DECODE4, lambda one: 2.0 if one else 1.0, 6)
    assert made == [True, False, True, False, True, False]        # alternating while timed
    assert chooser.choices() == {DECODE4: False} and not chooser.timing(DECODE4)
    assert drive(chooser, DECODE4, lambda one: 1.0, 10) == [False] * 10    # kept for `keep` steps
    # Kept long enough: timed again, and now one thread is faster (the machine's load changed).
    made = drive(chooser, DECODE4, lambda one: 0.5 if one else 3.0, 6)
    assert made == [True, False] * 3 and chooser.choices() == {DECODE4: True}
    assert drive(chooser, DECODE1, lambda one: 1.0, 6) == [True, False] * 3      # each kind on its own
    assert drive(chooser, PREFILL4, lambda one: 1.0 if one else 0.5, 6) == [True, False] * 3
    assert chooser.choices() == {DECODE1: True, DECODE4: True, PREFILL4: False}   # a tie: one thread


def test_medians_not_means_decide(timed):
    chooser = StepThreads(16, samples=3, keep=10)
    costs = iter([1.0, 2.0, 1.0, 2.0, 50.0, 2.0])                  # one slow outlier on one thread
    drive(chooser, (2, True), lambda one: next(costs), 6)
    assert chooser.choices() == {(2, True): True}


def test_large_steps_and_pinned_choices(timed, monkeypatch):
    chooser = StepThreads(16)
    assert not chooser.one_thread((16, True)) and not chooser.timing((16, True))
    assert not chooser.one_thread((300, False)) and not chooser.timing((300, False))
    monkeypatch.setenv("EDGECORE_SMALL_STEP_THREADS", "one")
    chooser = StepThreads(16)
    assert chooser.one_thread(DECODE4) and not chooser.timing(DECODE4) and not chooser.one_thread((16, True))
    monkeypatch.setenv("EDGECORE_SMALL_STEP_THREADS", "all")
    assert not StepThreads(16).one_thread(DECODE4)
    monkeypatch.setenv("EDGECORE_SMALL_STEP_THREADS", "two")
    with pytest.raises(ConfigError, match="EDGECORE_SMALL_STEP_THREADS"):
        StepThreads(16)


def test_the_engine_times_its_small_steps(timed, model_dir):
    import torch

    from edgecore.shared.engine.sampling_params import SamplingParams
    from tests.conftest import make_engine
    engine = make_engine(model_dir)
    seen = []
    flat_forward = engine.runner.flat.forward

    def recording(ids, *args):
        seen.append(torch.get_num_threads())
        return flat_forward(ids, *args)

    engine.runner.flat.forward = recording
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine.generate([list(range(5, 40))], SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert set(engine.runner.step_threads.choices()) == {(1, True)}   # 13 one-row decode steps: 10 timed
    assert seen[0] == 2                     # the 35-token prompt (flat too: a small step), on all threads
    assert seen[1:11] == [1, 2] * 5 and len(set(seen[11:])) == 1      # alternated, then one setting
