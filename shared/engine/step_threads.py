"""`StepThreads`: whether a small step runs on one thread or on all of them, chosen by timing the steps.

Life cycle: `ModelRunner` asks `one_thread(kind)` before each step, where kind is (tokens, pure decode?),
and, while that kind is being timed (`timing(kind)`), reports a completed step's wall time with
`record(kind, one, seconds)`. Steps of `below` tokens or more run on all threads. Each smaller kind's
first `2 × samples` steps alternate between one thread and all of them (alternating cancels the drift of
a growing context); the faster by median is then kept for `keep` steps, after which the kind is timed
again, since other load on the machine changes which is faster. EDGECORE_SMALL_STEP_THREADS
pins the choice: `one` (every small step on one thread) or `all`.

Why timed: the best choice depends on the CPU and on what else runs. On the 2-core VM that first measured
it, batch 8 and 16 steps of the bundled model were 2.5× faster on one thread (OpenMP forks and barriers
on every small op, workers descheduled by other jobs); on a 2-vCPU AMD EPYC, decode at batch 4 / 6 / 8 ran
1.10 / 1.14 / 1.20× faster on two threads, and batch 1-2 the same either way. No tensors here.
"""

from __future__ import annotations

import statistics

from edgecore.shared.node.env import small_step_threads

Kind = tuple[int, bool]     # (tokens in the step, whether it is a pure decode step)

SAMPLES = 5        # steps timed per setting before choosing
KEEP = 2048        # steps a choice is kept before that row count is timed again


class StepThreads:
    def __init__(self, below: int, samples: int = SAMPLES, keep: int = KEEP):
        self.below = below          # steps of at least this many tokens run on all threads
        self.samples, self.keep = samples, keep
        self.pinned = small_step_threads()       # "one", "all" or None (timed)
        self._timings: dict[Kind, tuple[list[float], list[float]]] = {}  # kind -> (one thread, all threads)
        self._chosen: dict[Kind, list] = {}                               # kind -> [one thread?, steps left]

    def one_thread(self, kind: Kind) -> bool:
        if kind[0] >= self.below:
            return False
        if self.pinned is not None:
            return self.pinned == "one"
        chosen = self._chosen.get(kind)
        if chosen is not None:
            if chosen[1] > 0:
                chosen[1] -= 1
                return chosen[0]
            del self._chosen[kind]          # kept long enough: time this kind again
        one, every = self._timings.setdefault(kind, ([], []))
        return len(one) <= len(every)

    def timing(self, kind: Kind) -> bool:
        """Whether a step of this kind is being timed (its wall time goes to `record`)."""
        return kind in self._timings

    def record(self, kind: Kind, one: bool, seconds: float) -> None:
        timings = self._timings.get(kind)
        if timings is None:
            return
        timings[0 if one else 1].append(seconds)
        if min(len(timings[0]), len(timings[1])) >= self.samples:
            del self._timings[kind]
            self._chosen[kind] = [statistics.median(timings[0]) <= statistics.median(timings[1]), self.keep]

    def choices(self) -> dict[Kind, bool]:
        """Kinds decided so far: True where they run on one thread."""
        return {kind: c[0] for kind, c in sorted(self._chosen.items())}
