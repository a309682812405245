"""A token bucket on a logger, so that nobody can flood a node's log by sending bad requests.

Life cycle: `limit_logger(name, rate, burst)` attaches one `LogBudget` filter
to the named logger (once; later calls return the same filter). Every record
takes a token; the bucket refills at `rate` tokens per second up to `burst`.
A record that finds the bucket empty is dropped and counted; the next record
that passes says how many were dropped before it, so the log stays honest
about what it left out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class LogBudget(logging.Filter):
    def __init__(self, rate: float = 1.0, burst: int = 10, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if rate <= 0 or burst < 1:
            raise ValueError("a log budget needs rate > 0 and burst ≥ 1")
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = float(burst)
        self.stamp = clock()
        self.suppressed = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            now = self.clock()
            self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens < 1:
                self.suppressed += 1
                return False
            self.tokens -= 1
            dropped, self.suppressed = self.suppressed, 0
        if dropped:
            record.msg = f"{record.msg} [{dropped} earlier log records from {record.name} suppressed]"
        return True


def limit_logger(name: str, rate: float = 1.0, burst: int = 10) -> LogBudget:
    logger = logging.getLogger(name)
    for f in logger.filters:
        if isinstance(f, LogBudget):
            return f
    budget = LogBudget(rate, burst)
    logger.addFilter(budget)
    return budget
