"""Exercise 06's grader: calling torch's ZeRO or FSDP scores 0 on the parts that do, and each
classic mistake of a sharded optimizer loses its own checks, saying what differs. Each
mistake is tests/solutions/06_zero.py with one piece changed, graded once, on 2 ranks.
"""

from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist

from exercises.grader import checks_06 as C6
from exercises.grader import core
from minidist.zero import ShardedOptimizer

SOLUTION = (Path(__file__).parent / "solutions" / "06_zero.py").read_text()

# the checks, by a word of their names
CHECKS = {"zero1": "gradients averaged beforehand", "state": "optimizer state",
          "reduce": "reduce_gradients=True", "zero2": "ZeRO-2 (each unit", "memory": "gradient memory",
          "bytes": "bytes:", "order": "reduce order", "bug": "find the bug"}

DIFFERS = "differs from one process's on the whole batch"
FREE = "        for p in u.params:\n            p.grad = None\n        out = "  # in _reduce
# name: (the edits (old, new) of the solution, the checks that must fail, a phrase of their messages)
MISTAKES = {
    "all-reduce, not reduce-scatter": ([(
        '            comm.reduce_scatter(out, inp, op="avg")\n',
        '            comm.all_reduce(inp, op="avg")\n            out.copy_(inp.chunk(self.world)[self.rank])\n')],
        {"bytes"}, "bytes [sent, received]"),
    "sums over ranks": ([('op="avg")', 'op="sum")'), ("ReduceOp.AVG", "ReduceOp.SUM")],
                        {"reduce", "zero2"}, DIFFERS),
    "no all-gather": ([("        works = [self._all_gather(u.flat, u.shard) for u in self.units]", "        works = []")],
                      {"zero1", "reduce", "zero2", "bytes"}, {"bytes": "step(): the collectives carried {}"}),
    "never frees p.grad": ([(FREE, "        out = ")], {"zero2", "memory"}, "AdamW, stage 2"),
    "frees at the end of backward": (
        [(FREE, "        out = "), ("        self._pending.clear()\n", "        self._pending.clear()\n"
                                   "        for p in self._unit_of:\n            p.grad = None\n")],
        {"memory"}, "were alive as full-size p.grad"),
    "inner optimizer on the whole parameters": (
        [("        return out\n\n    def _take_local_gradients",
          "        return out if self.reduce_gradients else [{**g, 'params': [p for p in g['params']"
          " if p.requires_grad]} for g in groups]\n\n    def _take_local_gradients"),
         ("            u.grad_shard.copy_(u.flat_grads()[u.lo:u.hi])", "            pass")],
        {"state"}, "the whole model's is"),
    "a full-size copy of the state kept aside": (
        [("        self.optim.step()\n", "        self.optim.step()\n        if not self.reduce_gradients:\n"
          "            self.kept = [torch.zeros(2 * u.flat.numel()) for u in self.units]\n")],
        {"state"}, "neither parameters nor gradients"),
    "no placeholder for an empty group": ([("                views = [v]\n", "                continue\n")],
                                          {"zero1"}, "one per param group passed in"),
    "stage 1 ignores no_sync": ([("        if self._no_sync:\n            return\n", "")], {"bytes"},
                                "(inside no_sync())"),
    "units reduced as they complete": (
        [("        while (self.stage == 2 and self._next < len(self.units)\n"
          "               and self.units[self._next].ready == len(self.units[self._next].params)):\n"
          "            self._reduce(self.units[self._next])\n            self._next += 1\n",
          "        u = self._unit_of[p]\n        if self.stage == 2 and u.ready == len(u.params):\n"
          "            self._reduce(u)\n            self._next = len(self.units)  # none left at the end\n")],
        {"order"}, "want one per unit, in unit index order"),
    "torch's ZeroRedundancyOptimizer inside": (
        [("        # ---- part 2: the hooks", "        if stage == 1 and not reduce_gradients:\n"
          "            from torch.distributed.optim import ZeroRedundancyOptimizer\n"
          "            self.torch = ZeroRedundancyOptimizer(ordered, optimizer_class)\n"
          "        # ---- part 2: the hooks")],
        {"zero1", "state"}, "torch.distributed.optim.ZeroRedundancyOptimizer was called at"),
    "torch's fully_shard inside": (
        [("        # ---- part 2: the hooks", "        if stage == 2 and module is not None:\n"
          "            from torch.distributed.fsdp import fully_shard\n            fully_shard(module)\n"
          "        # ---- part 2: the hooks")],
        {"zero2", "memory", "bytes"}, "torch.distributed.fsdp.fully_shard was called at"),
}


def _variant(tmp: Path, name: str) -> Path:
    text = SOLUTION
    for old, new in MISTAKES[name][0]:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    path = tmp / f"{name.replace(' ', '_').replace(',', '').replace(chr(39), '')}.py"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ex06")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C6, "WORLD_SIZES", (2,))
        return {name: (core.grade("06", path=(path := _variant(tmp, name))), path) for name in MISTAKES}


def _failed(result) -> dict:
    return {key: c.message for c in result.checks if not c.ok
            for key, word in CHECKS.items() if word in c.name}


def test_the_keys_name_each_check_once():
    names = [c.name for c in core.checks_of("06")]
    assert sorted(k for k, w in CHECKS.items() for n in names if w in n) == sorted(CHECKS)


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_loses_its_checks(mistake, graded):
    result, path = graded[mistake]
    _, must_fail, phrase = MISTAKES[mistake]
    failed = _failed(result)
    assert set(failed) == must_fail, failed
    for key, msg in failed.items():
        assert (phrase.get(key, DIFFERS) if isinstance(phrase, dict) else phrase) in msg, (key, msg)


@pytest.mark.parametrize("mistake", ["torch's ZeroRedundancyOptimizer inside", "torch's fully_shard inside"])
def test_a_forbidden_call_names_its_line_and_scores_its_parts_zero(mistake, graded):
    result, path = graded[mistake]
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1)
                if "ZeroRedundancyOptimizer(" in text or "fully_shard(module)" in text)
    for msg in _failed(result).values():
        assert f"{path.name}:{line}" in msg and "this part scores 0" in msg, msg
    assert 0 < result.points < result.max_points


def test_the_layout_written_out_is_the_units_the_exercise_builds():
    # the sizes the checks expect come from _layout; the units (minidist's Unit and
    # make_buckets, as the exercise's scaffold builds them), as rank r of n, have them
    for n in (2, 3):
        lay, empty = C6._layout(n), []
        for r in range(n):
            with mock.patch.object(dist, "get_rank", lambda group=None: r), \
                    mock.patch.object(dist, "get_world_size", lambda group=None: n):
                model = C6._model()
                opt = ShardedOptimizer(C6._groups(model, "adamw"), lambda groups: None,
                                       bucket_cap_mb=C6.CAP_MB, module=model)
            assert sum(u.flat.numel() for u in opt.units) == lay["padded"]
            assert sum(b - a for u in opt.units for a, b in u.ranges.values()) == lay["owned"][r]
            empty.append(all(2 not in u.ranges for u in opt.units))
        assert any(empty) and (lay["padded"] > lay["psi"]) == (n == 3)
