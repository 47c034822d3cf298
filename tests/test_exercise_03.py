"""Exercise 03's grader: torch's wrappers score 0 where they are used, and each planted
mistake in the chapter's solution (tests/solutions/03_data_parallel.py, which waits for
its buckets in an autograd callback) loses its own checks. (tests/test_exercises.py grades
the stubs, minidist's reference and that solution.) Mistakes are graded on 2 ranks."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from exercises.grader import checks_03, core

SOLUTION = (Path(__file__).resolve().parent / "solutions" / "03_data_parallel.py").read_text()
LAUNCH = "            self.works[self.next] = dist.all_reduce(self.buffers[self.next], async_op=True)\n"
WRAPPED = '''
class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        self.inner = {call}

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)
'''
NN, END = "import torch.nn as nn\n", "\n\n# Where minidist"
HEAD = '        """Launch, in bucket order, every bucket that is full and next in line."""\n'
AS_FILLED = """        for b, params in enumerate(self.buckets):
            if self.works[b] is None and len(self.ready[b]) == len(params):
                self.works[b] = dist.all_reduce(self.buffers[b], async_op=True)
        self.next = len(self.buckets) if None not in self.works else 0
        return
"""
RANKS = {"construction", "several", "one bucket", "overlap", "one all_reduce", "launch order"}  # all but 2
# name: (replacements in the solution, the checks that must fail (by a word of their names)[,
# those that may fail too: where buckets of equal sizes fill out of order is autograd's choice])
MISTAKES = {
    "none: the chapter's solution, waiting in an autograd callback": ([], set()),
    "torch's DDP": ([(END, WRAPPED.format(call="torch.nn.parallel.DistributedDataParallel(module)") + END)],
                    RANKS),
    "fully_shard": ([(NN, NN + "from torch.distributed.fsdp import fully_shard\n"),
                     (END, WRAPPED.format(call="fully_shard(module)") + END)], RANKS),
    "sums, never averages": ([("            self.buffers[b].div_(self.world)\n", "")],
                             {"several", "one bucket"}),
    "no broadcast at construction": ([("dist.broadcast(t, src=0)\n", "pass\n")],
                                     {"construction", "several", "one bucket"}),
    "every bucket launched after backward": ([("        self.ready[b].add(i)\n        self._launch_ready()\n",
                                               "        self.ready[b].add(i)\n")], {"overlap"}),
    "synchronous all-reduces in the hooks": (
        [(LAUNCH, LAUNCH + LAUNCH[:12] + "self.works[self.next].wait()\n")], {"overlap"}),
    "buckets launched as they fill": ([(HEAD, HEAD + AS_FILLED)], {"launch order"}, {"one all_reduce"}),
    "bucket_by_dtype as shipped": ([], {"find the bug"}),
    # last: rank 1's all-reduces meet rank 0's of other buckets; equal sizes sum the wrong
    # gradients, different sizes make gloo abort the ranks (the next grading starts new ones)
    "rank 1 launches buckets as they fill": (
        [(HEAD, HEAD + "        if dist.get_rank() == 1:\n" + textwrap.indent(AS_FILLED, "    "))],
        {"launch order"}, {"several", "one bucket", "one all_reduce"}),
}


def variant(mistake: str) -> str:
    """The solution with `mistake` planted."""
    text = SOLUTION
    for old, new in MISTAKES[mistake][0]:
        assert old in text, (mistake, old)
        text = text.replace(old, new)
    if mistake == "bucket_by_dtype as shipped":
        shipped = core.learner_file("03").read_text()
        cut = [(t.index("def bucket_by_dtype"), t.index("\n\n# Where minidist")) for t in (shipped, text)]
        text = text[:cut[1][0]] + shipped[slice(*cut[0])] + text[cut[1][1]:]
    return text


@pytest.fixture(scope="module")
def grade(tmp_path_factory):
    """grade(mistake) -> Result, graded once per mistake, on 2 ranks."""
    done, mp = {}, pytest.MonkeyPatch()
    mp.setattr(checks_03, "WORLD_SIZES", (2,))

    def run(mistake):
        if mistake not in done:
            path = tmp_path_factory.mktemp("ex03") / "03_data_parallel.py"
            path.write_text(variant(mistake))
            # importing FSDP costs seconds in each process that loads the file: here only the ranks
            keep = {k: core.resolve(v) for k, v in core.reference_table(path).items()
                    if k != "BucketedDDP"} if mistake == "fully_shard" else {}
            done[mistake] = core.grade("03", path=path, overrides=keep)
        return done[mistake]
    yield run
    mp.undo()


def _failed(result):
    return {c.name: c.message for c in result.checks if not c.ok}


def test_the_solution_waits_for_its_buckets_the_way_the_chapter_does():
    assert "_execution_engine.queue_callback(self._end_of_backward)" in SOLUTION
    assert "register_post_accumulate_grad_hook" in SOLUTION and "async_op=True" in SOLUTION


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistake_loses_its_checks_and_only_those(grade, mistake):
    failed = _failed(grade(mistake))
    must, may = MISTAKES[mistake][1], (MISTAKES[mistake][2:] or [set()])[0]
    assert {w for w in must if any(w in name for name in failed)} == must, failed
    assert all(any(w in name for w in must | may) for name in failed), failed


@pytest.mark.parametrize("mistake", ["torch's DDP", "fully_shard"])
def test_torch_wrappers_score_0_naming_the_rule_and_the_line(grade, mistake):
    call = "DistributedDataParallel" if mistake == "torch's DDP" else "fully_shard"
    line = next(i for i, ln in enumerate(variant(mistake).splitlines(), 1) if "self.inner = " in ln)
    for name, msg in _failed(grade(mistake)).items():
        assert f"{call} was called at" in msg and f"03_data_parallel.py:{line}," in msg, (name, msg)
        assert "which this exercise forbids" in msg and "this part scores 0" in msg, (name, msg)


def test_messages_say_what_differs(grade):
    failed = _failed(grade("sums, never averages"))
    assert any("2 times as large" in m for m in failed.values()), failed
    failed = _failed(grade("buckets launched as they fill"))
    assert any("bucket index order" in m and "filled buckets [2, 1, 0]" in m for m in failed.values()), failed
    failed = _failed(grade("synchronous all-reduces in the hooks"))
    assert any("waited for a collective before its last gradient" in m for m in failed.values()), failed
    failed = _failed(grade("every bucket launched after backward"))
    assert any("started before the last gradient" in m for m in failed.values()), failed
    failed = _failed(grade("rank 1 launches buckets as they fill"))
    assert any("collectives did not match" in m for n, m in failed.items() if "launch order" in n), failed
