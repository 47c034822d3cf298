"""The grader: it runs your code, compares what it does with an oracle, and says what differs
(what it compares, and its one rule, are the README's "Exercises and grading"). Read core,
apart, ranks, rules (and forbid), cli, then an exercise's checks_NN.py."""

from exercises.grader.core import check
from exercises.grader.ranks import Cache, close, differ, first_problem, per_world_size, run_all
from exercises.grader.rules import Rules, events, oracle, randn, ring_direction

__all__ = ["Cache", "Rules", "check", "close", "differ", "events", "first_problem", "oracle", "per_world_size",
           "randn", "ring_direction", "run_all"]
