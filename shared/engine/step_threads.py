"""`StepThreads`: whether a small step runs on one thread or on all of them, chosen by timing the steps.

Life cycle: `ModelRunner` asks `one_thread(rows)` before each step of fewer than `below` tokens and, while
that row count is being timed, reports the step's wall time with `record(rows, one, seconds)`. Each row
count's first `2 × samples` steps alternate between one thread and all of them (alternating cancels the
drift of a growing context); the faster by median is then kept for `keep` steps, after which the row
count is timed again, since other load on the machine changes which is faster. EDGECORE_SMALL_STEP_THREADS
pins the choice: `one` (every small step on one thread) or `all`.

Why timed: the best choice depends on the CPU and on what else runs. On the 2-core VM that first measured
it, batch 8 and 16 steps of the bundled model were 2.5× faster on one thread (OpenMP forks and barriers
on every small op, workers descheduled by other jobs); on a 2-vCPU AMD EPYC, decode at batch 4 / 6 / 8 ran
1.10 / 1.14 / 1.20× faster on two threads, and batch 1-2 the same either way. No tensors here.
"""

from __future__ import annotations

import statistics

from edgecore.shared.env import small_step_threads

SAMPLES = 5        # steps timed per setting before choosing
KEEP = 2048        # steps a choice is kept before that row count is timed again


class StepThreads:
    def __init__(self, below: int, samples: int = SAMPLES, keep: int = KEEP):
        self.below = below          # steps of at least this many tokens run on all threads
        self.samples, self.keep = samples, keep
        self.pinned = small_step_threads()       # "one", "all" or None (timed)
        self._timings: dict[int, tuple[list[float], list[float]]] = {}   # rows -> (one thread, all threads)
        self._chosen: dict[int, list] = {}                                # rows -> [one thread?, steps left]

    def one_thread(self, rows: int) -> bool:
        if rows >= self.below:
            return False
        if self.pinned is not None:
            return self.pinned == "one"
        chosen = self._chosen.get(rows)
        if chosen is not None:
            chosen[1] -= 1
            if chosen[1] > 0:
                return chosen[0]
            del self._chosen[rows]          # kept long enough: time this row count again
        one, every = self._timings.setdefault(rows, ([], []))
        return len(one) <= len(every)

    def timing(self, rows: int) -> bool:
        """Whether a step of `rows` tokens is being timed (its wall time goes to `record`)."""
        return rows in self._timings

    def record(self, rows: int, one: bool, seconds: float) -> None:
        timings = self._timings.get(rows)
        if timings is None:
            return
        timings[0 if one else 1].append(seconds)
        if min(len(timings[0]), len(timings[1])) >= self.samples:
            del self._timings[rows]
            self._chosen[rows] = [statistics.median(timings[0]) <= statistics.median(timings[1]), self.keep]

    def choices(self) -> dict[int, bool]:
        """Row counts decided so far: True where they run on one thread."""
        return {rows: c[0] for rows, c in sorted(self._chosen.items())}
