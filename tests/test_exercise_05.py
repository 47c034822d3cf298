"""Exercise 05's grader: each planted mistake in a solution loses its checks (and only
those), torch's GradScaler inside the scaler scores 0 on the parts that use it (naming the
rule and the line) while the find-the-bug part keeps its points, and the grader's written
rule is GradScaler's at hysteresis=1. (tests/test_exercises.py grades the stub, minidist
and tests/solutions/05_mixed_precision.py.) A mistake is the solution with lines replaced.
"""

from pathlib import Path

import pytest

from exercises.grader import checks_05 as C5
from exercises.grader import core

SOLUTION = (Path(__file__).parent / "solutions" / "05_mixed_precision.py").read_text()
CHECK = {"scale": "scale() and unscale_()", "random": "random inf",
         "ceiling": "float32's maximum", "hysteresis": "hysteresis 2 and 3", "misuse": "misuse refused",
         "min_scale": "min_scale:", "state": "state_dict", "ranks": "2 ranks", "shards": "find the bug"}
ONE_PROCESS = set(CHECK) - {"ranks", "shards"}

MISTAKES = {  # name: ([(line in the solution, what replaces it)], the checks that must fail)
    "never skips": ([("return None if self.found else optimizer.step()", "return optimizer.step()")],
                    {"random", "ceiling", "hysteresis", "min_scale"}),
    "no hysteresis": ([("if self.streak >= self.hysteresis:", "if True:")], {"hysteresis", "min_scale"}),
    "a clean step keeps the streak": ([("self.streak, self.tracker = 0, self.tracker + 1",
                                        "self.tracker = self.tracker + 1")], {"hysteresis", "min_scale"}),
    "an overflow keeps the growth tracker": ([("self.streak, self.tracker = self.streak + 1, 0",
                                               "self.streak += 1")], {"random", "hysteresis"}),
    "NaN missed": ([("all(bool(torch.isfinite(g).all()) for g in grads)",
                     "not any(bool(torch.isinf(g).any()) for g in grads)")],
                   {"random", "ceiling", "hysteresis"}),
    "grows past float32's max": ([("<= torch.finfo(torch.float32).max", "< float('inf')")], {"ceiling"}),
    "no error at min_scale": ([("if self.s <= self.min_scale:", "if False:")], {"min_scale"}),
    "an error that names no remedy": ([(" Try a lower learning rate, gradient ", ""),
                                       ('"clipping, or bf16"', '""')], {"min_scale"}),
    "a state without the counters": ([('"tracker": self.tracker, "streak": self.streak}',
                                       '"tracker": 0, "streak": 0}')], {"state"}),
    "step() unscales again": ([("if self.found is None:\n            self.unscale_(optimizer)",
                                "self.found = None\n        self.unscale_(optimizer)")],
                              {"scale", "random", "misuse"}),
    "never unscales": ([("g.div_(self.s)", "pass")], {"scale", "random", "misuse"}),
    "a second unscale_() divides again": (
        [('raise RuntimeError("unscale_() was already called since the last update()")', "pass")],
        {"misuse"}),
    "update() without a verdict is a clean step": (
        [('raise RuntimeError("update() with no unscale_() or step() since the last update()")',
          "self.found = False")], {"misuse"}),
}

WRAPS_GRADSCALER = '''

class LossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=1, min_scale=1.0):
        self.g = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                      backoff_factor=backoff_factor, growth_interval=growth_interval)

    def __getattr__(self, name):
        return getattr(self.g, name)
'''


def _variant(tmp_path, edits, extra: str = "") -> Path:
    text = SOLUTION
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "05_mixed_precision.py"
    path.write_text(text + extra)
    return path


def _failed(result) -> dict:
    return {next(k for k, v in CHECK.items() if v in c.name): c.message for c in result.checks if not c.ok}


def _one_process(monkeypatch):
    monkeypatch.setitem(core.CHECKS, "05", [c for c in core.checks_of("05")
                                            if not c.name.startswith(("2 ranks", "find the bug"))])


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistake_loses_its_checks(mistake, tmp_path, monkeypatch):
    edits, must_fail = MISTAKES[mistake]
    _one_process(monkeypatch)
    r = core.grade("05", path=_variant(tmp_path, edits))
    failed = _failed(r)
    assert set(failed) == must_fail, failed
    assert all("not implemented" not in m for m in failed.values()), failed


def test_ranks_that_decide_alone_lose_the_ranks_check(tmp_path):
    edits = [("        if dist.is_initialized() and dist.get_world_size() > 1:\n"
              "            dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n        return flag",
              "        return flag")]
    failed = _failed(core.grade("05", path=_variant(tmp_path, edits)))
    assert set(failed) == {"ranks"}, failed
    assert "rank 0" in failed["ranks"] and "want (True" in failed["ranks"], failed


@pytest.mark.parametrize("which", ["torch.amp", "torch.cuda.amp"])
def test_gradscaler_inside_scores_0_on_its_parts_only(which, tmp_path, monkeypatch):
    if which != "torch.amp":  # torch.cuda.amp's: one process only (the rule is the same)
        _one_process(monkeypatch)
    code = WRAPS_GRADSCALER.replace('torch.amp.GradScaler("cpu", ', f"{which}.GradScaler(")
    path = _variant(tmp_path, [], code)
    line = next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if f"{which}.GradScaler(" in ln)
    failed = _failed(core.grade("05", path=path))
    assert set(failed) == (ONE_PROCESS | {"ranks"} if which == "torch.amp" else ONE_PROCESS), failed
    for msg in failed.values():
        assert f"{which}.GradScaler was called at" in msg and f"{path.name}:{line}" in msg, msg
        assert "scores 0" in msg, msg


def test_the_written_rule_is_gradscalers_at_hysteresis_1():
    patterns = [(p, kw) for _, p, kw in C5.RANDOM + [C5.CEILING]]
    patterns += [(C5._union(steps), kw) for steps, kw in C5.RANKS.values() if "hysteresis" not in kw]
    for pattern, kw in patterns:
        assert C5._trajectory(C5._gradscaler(pattern, **kw)) == C5._rule(pattern, **kw)


def test_the_rule_by_hand_and_the_patterns_in_range():
    # hysteresis=2, growth_interval=3 from 1024, worked out from the exercise's words
    _, pattern, kw = C5.HYSTERESIS[0]
    assert [s for _, s in C5._rule(pattern, **kw)] == [
        1024, 1024, 1024, 512, 256, 256, 256, 256, 256, 256, 512, 512, 256, 256, 256, 512]
    assert [s for _, s in C5._rule("II", init_scale=12.0, min_scale=8.0)] == [8.0, None]
    assert [s for _, s in C5._rule("I.IIII", init_scale=32.0, min_scale=8.0, hysteresis=2)] == [
        32.0, 32.0, 32.0, 16.0, 8.0, None]
    for _, pattern, kw in C5.RANDOM + C5.HYSTERESIS[1:]:
        scales = [s for _, s in C5._rule(pattern, **kw)]
        assert len(set(scales)) > 10 and 2.0**-40 < min(scales) and max(scales) < 2.0**100
    scales = [s for _, s in C5._rule(C5.CEILING[1], **C5.CEILING[2])]
    assert scales.count(2.0**127) > 20  # growth refused there, often
    for steps, kw in C5.RANKS.values():  # each rank alone would decide otherwise
        for r in (0, 1):
            assert C5._rule("".join(s[r] for s in steps), **kw) != C5._rule(C5._union(steps), **kw)
