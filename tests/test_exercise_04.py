"""Exercise 04's grader: each planted mistake in the chapter's solution
(tests/solutions/04_grad_accum.py) loses its own checks, and a forbidden call scores 0 in
the parts that make it, naming the rule and the line. (tests/test_exercises.py grades the
stubs, minidist's reference and that solution.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from exercises.grader import core

SOLUTION = (Path(__file__).resolve().parent / "solutions" / "04_grad_accum.py").read_text()
COUNT = "    dist.all_reduce(count)\n"
SYNC = "        with contextlib.nullcontext() if ddp is None or last else ddp.no_sync():\n"
BACKWARD = "            (loss_sum * (world_size / count)).backward()\n"
GATHER = """    if ddp is not None:
        everyone = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(everyone, count)
        count = sum(everyone)
    else:
        dist.all_reduce(count)
"""
CHECKS = {"1 rank": "1 rank", "ddp": "under DDP: gradient", "plain": "ddp=None", "loss": "mean loss",
          "no_sync": "last micro-step"}
MISTAKES = {  # name: (replacements in the solution, the checks that must fail, a phrase of their messages)
    "no no_sync: every micro-step communicates": (
        [(SYNC, "        with contextlib.nullcontext():\n")], {"no_sync"}, "want [0, "),
    "the mean of per-micro-batch means": (
        [(BACKWARD, "            (loss_sum / (y != -1).sum() / len(micro_batches)).backward()\n")],
        {"1 rank", "ddp", "plain"}, "the gradient of the mean of per-micro-batch means"),
    "one process's recipe on each rank": (
        [(COUNT, ""), (BACKWARD, BACKWARD.replace("world_size / count", "1 / count"))],
        {"ddp", "plain", "loss"}, "each rank's sum over its own token count"),
    "no world_size factor": ([(BACKWARD, BACKWARD.replace("world_size / count", "1 / count"))],
                             {"ddp", "plain"}, "0.5 times as large"),
    "forward_backward when ddp is None": (
        [("    # the unmasked targets", "    if ddp is None:\n        from minidist.train import "
          "forward_backward\n        return forward_backward(model, micro_batches, world_size)\n"
          "    # the unmasked targets")],
        {"1 rank", "plain", "loss"}, "minidist.train.forward_backward was called at"),
    "the count all-gathered under DDP": ([(COUNT, GATHER)], {"ddp", "loss", "no_sync"},
                                         "dist.all_gather was called at"),
}


def variant(mistake: str) -> str:
    text = SOLUTION
    for old, new in MISTAKES[mistake][0]:
        assert old in text, (mistake, old)
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def grade(tmp_path_factory):
    """grade(mistake) -> Result, graded once per mistake."""
    done = {}

    def run(mistake):
        if mistake not in done:
            path = tmp_path_factory.mktemp("ex04") / "04_grad_accum.py"
            path.write_text(variant(mistake))
            done[mistake] = core.grade("04", path=path)
        return done[mistake]
    return run


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistake_loses_its_checks_and_only_those(grade, mistake):
    _, must_fail, phrase = MISTAKES[mistake]
    failed = {c.name: c.message for c in grade(mistake).checks if not c.ok}
    which = {k for k, word in CHECKS.items() if any(word in name for name in failed)}
    assert which == must_fail, failed
    assert any(phrase in msg for msg in failed.values()), failed


@pytest.mark.parametrize("mistake", ["forward_backward when ddp is None", "the count all-gathered under DDP"])
def test_a_forbidden_call_names_the_rule_and_its_line(grade, mistake):
    call = "forward_backward(" if "forward_backward" in mistake else "dist.all_gather("
    line = next(i for i, ln in enumerate(variant(mistake).splitlines(), 1)
                if call in ln and "import" not in ln)
    ruled = [msg for c in grade(mistake).checks if not c.ok for msg in [c.message] if "forbids" in msg]
    assert ruled and all(f"04_grad_accum.py:{line}," in msg and "scores 0" in msg for msg in ruled), ruled
