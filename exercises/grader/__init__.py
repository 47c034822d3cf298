"""The grader: it runs your code, compares what it does with an oracle, and says what differs.

For each exercise it runs the functions you wrote (in processes of their own), compares
what they do with an oracle (one process, torch's own implementation, a formula written
here), the values, the gradients and, where that is the point of the exercise, the
collectives your code issues and the bytes they carry, or the memory it holds; and it
names the rule when your code calls the very thing the exercise builds (torch's collectives
in 02, DistributedDataParallel in 03, GradScaler in 05, ...): that check scores 0, with the
line of the call and what to use instead. It is feedback, not a sandbox: import what you
like. Read core, apart, ranks, rules (and forbid), cli, then an exercise's checks_NN.py.
"""

from exercises.grader.core import check
from exercises.grader.ranks import Cache, close, first_problem, per_world_size, run_all
from exercises.grader.rules import Rules, events, oracle

__all__ = ["Cache", "Rules", "check", "close", "events", "first_problem", "oracle", "per_world_size", "run_all"]
