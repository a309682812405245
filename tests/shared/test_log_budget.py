"""The log budget: a token bucket per logger, dropped records counted and reported."""

import logging

from edgecore.shared.node.log_budget import LogBudget, limit_logger


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_bucket_drops_beyond_burst_refills_and_reports_what_it_dropped():
    clock = Clock()
    budget = LogBudget(rate=2.0, burst=3, clock=clock)
    logger = logging.getLogger("edgecore.test.budget")
    logger.propagate = False
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    logger.addFilter(budget)
    try:
        for i in range(10):
            logger.warning("bad request %d", i)
        assert seen == ["bad request 0", "bad request 1", "bad request 2"]
        clock.t = 0.5                      # one token back
        logger.warning("later")
        assert seen[-1] == "later [7 earlier log records from edgecore.test.budget suppressed]"
        logger.warning("dropped")
        assert len(seen) == 4
    finally:
        logger.removeFilter(budget)
        logger.removeHandler(handler)


def test_limit_logger_attaches_one_filter():
    a = limit_logger("edgecore.test.once")
    assert limit_logger("edgecore.test.once") is a
    assert sum(isinstance(f, LogBudget) for f in logging.getLogger("edgecore.test.once").filters) == 1
