"""Exercise 05's grader catches the classic mistakes of a loss scaler, each in the checks
it belongs to; a solution written the way the exercise asks scores full; and the
grader's own oracles hold together (its written-out rule is GradScaler's at
hysteresis=1, its hand-worked sequences follow the rule, its patterns stay in range).

(tests/test_exercises.py proves that the stub scores 0 and minidist scores full.) Each
process launch costs seconds here, so one launch runs the 2-rank part for the plain
solution and for the mistake that concerns ranks; the other mistakes are graded by the
single-process checks.
The scalers live at module level: cloudpickle ships them to the ranks by name.
"""

import importlib
import math

import pytest
import torch
import torch.distributed as dist

from exercises import checks_05 as C5
from exercises import grade as G
from grading_helpers import assert_keys_name_each_check_once, failed_checks


# -- 0. a plain solution, written the way the exercise asks; the mistakes change one piece

class Plain:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=1, min_scale=1.0):
        self.s, self.gf, self.bf = float(init_scale), growth_factor, backoff_factor
        self.gi, self.h, self.min_scale = growth_interval, hysteresis, min_scale
        self.tracker = self.streak = 0
        self.found = None

    def scale(self, loss):
        return loss * self.s

    def get_scale(self):
        return self.s

    def _overflowed(self, grads):
        return not all(bool(torch.isfinite(g).all()) for g in grads)

    def _agree(self, flag):
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def unscale_(self, optimizer):
        if self.found is not None:  # as GradScaler: once per step
            raise RuntimeError("unscale_() was already called since the last update()")
        self._unscale(optimizer)

    @torch.no_grad()
    def _unscale(self, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for g in grads:
            g.div_(self.s)
        flag = torch.tensor([1.0 if self._overflowed(grads) else 0.0])
        self.found = bool(self._agree(flag).item())

    def step(self, optimizer):
        if self.found is None:
            self.unscale_(optimizer)
        return None if self.found else optimizer.step()

    def update(self):
        if self.found is None:  # as GradScaler: no verdict, nothing to act on
            raise RuntimeError("update() with no unscale_() or step() since the last update()")
        self._overflow() if self.found else self._clean()
        self.found = None

    def _collapse(self):
        raise FloatingPointError(f"loss scale at min_scale={self.min_scale} and still overflowing: "
                                 "try a lower learning rate, gradient clipping or bf16")

    def _overflow(self):
        self.streak, self.tracker = self.streak + 1, 0
        if self.streak >= self.h:
            if self.s <= self.min_scale:
                self._collapse()
            self.s = max(self.s * self.bf, self.min_scale)

    def _grow(self):
        if self.s * self.gf <= torch.finfo(torch.float32).max:
            self.s *= self.gf

    def _clean(self):
        self.streak, self.tracker = 0, self.tracker + 1
        if self.tracker == self.gi:
            self.tracker = 0
            self._grow()

    def state_dict(self):
        return {"scale": self.s, "tracker": self.tracker, "streak": self.streak}

    def load_state_dict(self, state):
        self.s, self.tracker, self.streak = state["scale"], state["tracker"], state["streak"]


# -- the mistakes

class NeverSkips(Plain):  # right verdict, but steps anyway
    def step(self, optimizer):
        if self.found is None:
            self.unscale_(optimizer)
        return optimizer.step()


class NoHysteresis(Plain):  # every overflow backs off
    def _overflow(self):
        self.tracker = 0
        if self.s <= self.min_scale:
            self._collapse()
        self.s = max(self.s * self.bf, self.min_scale)


class CleanStepKeepsStreak(Plain):  # DeepSpeed's default: only growth refills the allowance
    def _clean(self):
        self.tracker += 1
        if self.tracker == self.gi:
            self.tracker = self.streak = 0
            self._grow()


class TrackerKeptOnOverflow(Plain):  # an overflow does not restart the count to growth
    def _overflow(self):
        tracker = self.tracker
        super()._overflow()
        self.tracker = tracker


class IsinfOnly(Plain):  # NaN slips through
    def _overflowed(self, grads):
        return any(bool(torch.isinf(g).any()) for g in grads)


class GrowsPastFp32(Plain):  # Python floats go to 1.8e308; the loss is fp32
    def _grow(self):
        if math.isfinite(self.s * self.gf):
            self.s *= self.gf


class NoCollapseError(Plain):  # sits at min_scale forever
    def _collapse(self):
        pass


class UnhelpfulCollapseError(Plain):
    def _collapse(self):
        raise FloatingPointError("loss scale collapsed")


class StateWithoutCounters(Plain):
    def state_dict(self):
        return {"scale": self.s}

    def load_state_dict(self, state):
        self.s = state["scale"]


class UnscalesTwice(Plain):  # step() unscales even after unscale_()
    def step(self, optimizer):
        self._unscale(optimizer)
        return None if self.found else optimizer.step()


class SecondUnscaleDivides(Plain):  # a second unscale_() in a step divides again, silently
    def unscale_(self, optimizer):
        self._unscale(optimizer)


class BareUpdateIsClean(Plain):  # update() without a verdict counts as a clean step
    def update(self):
        self._overflow() if self.found else self._clean()
        self.found = None


class NeverUnscales(Plain):  # right verdict, but the optimizer sees S times the gradient
    @torch.no_grad()
    def unscale_(self, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.found = bool(self._agree(torch.tensor([1.0 if self._overflowed(grads) else 0.0])).item())


class LocalVerdict(Plain):  # each rank decides alone
    def _agree(self, flag):
        return flag


# The checks of exercise 05, by a word of their names.
CHECK5 = {"scale": "scale() and unscale_()", "random": "random inf", "params": "skipped steps leave",
          "ceiling": "float32's maximum", "hysteresis": "hysteresis: back off",
          "nonfinite": "NaN and -inf are", "min_scale": "min_scale:", "state": "state_dict",
          "ranks": "2 ranks", "shards": "find the bug", "misuse": "misuse refused"}

MISTAKES5 = {
    # name: (scaler, checks that must fail, a phrase each failure message contains)
    "never skips": (NeverSkips, {"random", "params", "ceiling", "hysteresis", "nonfinite", "min_scale"},
                    "optimizer.step()"),
    "no hysteresis": (NoHysteresis, {"hysteresis", "min_scale"}, "back off only once the streak"),
    "a clean step keeps the streak": (CleanStepKeepsStreak, {"hysteresis", "min_scale"},
                                      "a clean step ends a streak"),
    "growth tracker kept on overflow": (TrackerKeptOnOverflow, {"random", "hysteresis"},
                                        "resets the tracker"),
    "inf only, NaN missed": (IsinfOnly, {"random", "params", "ceiling", "hysteresis", "nonfinite"},
                             "isfinite"),
    "grows past float32's max": (GrowsPastFp32, {"ceiling"}, "float32's largest value"),
    "no error at min_scale": (NoCollapseError, {"min_scale"}, "no FloatingPointError"),
    "an error that says nothing": (UnhelpfulCollapseError, {"min_scale"}, "say what to try"),
    "state without counters": (StateWithoutCounters, {"state"}, "growth tracker and the overflow streak"),
    "unscales twice": (UnscalesTwice, {"scale", "params", "misuse"}, "divided by S twice"),
    "never unscales": (NeverUnscales, {"scale", "params", "misuse"}, "S times too large"),
    "a second unscale_ divides again": (SecondUnscaleDivides, {"misuse"}, "raised nothing"),
    "update() without a verdict is a clean step": (BareUpdateIsClean, {"misuse"},
                                                   "no verdict to act on"),
}


def _failed(result):
    return failed_checks(result, CHECK5)


def test_05_check_keys_name_each_check_once():
    assert_keys_name_each_check_once("05", CHECK5)


@pytest.mark.parametrize("mistake", list(MISTAKES5))
def test_05_mistake_loses_the_points_of_its_checks(mistake, monkeypatch):
    scaler, must_fail, phrase = MISTAKES5[mistake]
    # the single-process checks only: a launch per mistake would cost seconds each
    monkeypatch.setitem(G.CHECKS, "05", [c for c in G.checks_of("05") if CHECK5["ranks"] not in c.name
                                         and CHECK5["shards"] not in c.name])
    r = G.grade("05", overrides=dict(LossScaler=scaler))
    which, messages = _failed(r)
    assert which == must_fail, messages
    assert 0 < r.points < r.max_points
    for name, msg in messages.items():
        assert "not implemented" not in msg, (name, msg)
        # the misuse check fails with its own words when a mistake also breaks the step after
        assert phrase in msg or (CHECK5["misuse"] in name and must_fail != {"misuse"}), (name, msg)


def _plain_on_ranks(fns, r, n):
    return C5._ranks_part({"LossScaler": Plain}, r, n)


def _local_on_ranks(fns, r, n):
    return C5._ranks_part({"LossScaler": LocalVerdict}, r, n)


def plain_unscale_shards(shards, scale):  # the shipped function, its verdict all-reduced
    flag = torch.tensor([0.0])
    for g in shards:
        g.div_(scale)
        flag = torch.maximum(flag, (~torch.isfinite(g)).any().float().reshape(1))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _shards_on_ranks(fn, fns, r, n):
    return C5._shards_part({"unscale_shards": fn}, r, n)


def test_05_a_plain_solution_scores_full_and_ranks_that_decide_alone_lose_the_ranks_check(monkeypatch):
    # both on 2 ranks in one launch (each costs seconds), then graded as the grader would;
    # the find-the-bug part too, fixed and as shipped
    import functools
    shipped = importlib.import_module("exercises.05_mixed_precision").unscale_shards
    ranks = C5.H.run_all({"plain": _plain_on_ranks, "local": _local_on_ranks,
                          "fixed": functools.partial(_shards_on_ranks, plain_unscale_shards),
                          "shipped": functools.partial(_shards_on_ranks, shipped)}, {},
                         {2: ["plain", "local", "fixed", "shipped"]}, C5.TIMEOUT_S, C5.HANG_HINT,
                         C5.RULES)
    for scaler, part, shards in ((Plain, "plain", "fixed"), (LocalVerdict, "local", "shipped")):
        monkeypatch.setattr(C5, "_results", lambda impl, part=part, shards=shards: {
            ("ranks", 2): ranks[part, 2], ("shards", 2): ranks[shards, 2]})
        r = G.grade("05", overrides=dict(LossScaler=scaler))
        which, messages = _failed(r)
        if scaler is Plain:
            assert r.points == r.max_points, messages
        else:
            assert which == {"ranks", "shards"}, messages
            assert "ReduceOp.MAX" in messages[next(n for n in messages if CHECK5["ranks"] in n)]
            assert "drift apart" in messages[next(n for n in messages if CHECK5["shards"] in n)]


def test_05_the_stub_is_graded_without_starting_processes(monkeypatch):
    # only the find-the-bug part, shipped code, goes to the ranks
    plans = []

    def launch(parts, fns, plan, *a, **k):
        plans.append(plan)
        return {("shards", 2): ("error", "not run in this test")}
    monkeypatch.setattr(C5.H, "run_all", launch)
    r = G.grade("05")
    assert plans == [{2: ["shards"]}] and r.points == 0
    assert all(c.message.startswith("not implemented: ") for c in r.checks
               if CHECK5["shards"] not in c.name)


# -- the grader's oracles

def test_05_the_written_rule_is_gradscalers_at_hysteresis_1():
    for _, pattern, kw in C5.RANDOM + [C5.CEILING]:
        assert C5._trajectory(C5._gradscaler(pattern, **kw)) == C5._rule(pattern, **kw)


def test_05_hand_worked_sequences_follow_the_rule():
    _, pattern, kw, scales = C5.HYSTERESIS_2
    assert C5._rule(pattern, **kw) == [(k != ".", float(s)) for k, s in zip(pattern, scales)]
    _, pattern, scales = C5.NONFINITE
    kw = dict(init_scale=1024.0, growth_interval=1000)
    want = [(k != ".", float(s)) for k, s in zip(pattern, scales)]
    assert C5._rule(pattern, **kw) == want == C5._trajectory(C5._gradscaler(pattern, **kw))
    for kw, pattern, scales in C5.MIN_SCALE:
        assert [s for _, s in C5._rule(pattern[:-1], **kw)] == scales
        assert scales[-1] == kw["min_scale"] and pattern[-1] != "."  # the last step must raise
    for _, (steps, kw) in C5.RANKS.items():  # each rank alone would decide differently
        union = "".join(next((k for k in s if k != "."), ".") for s in steps)
        for r in (0, 1):
            assert C5._rule("".join(s[r] for s in steps), **kw) != C5._rule(union, **kw)


def test_05_patterns_move_the_scale_and_stay_in_range():
    for _, pattern, kw in C5.RANDOM:
        scales = [s for _, s in C5._rule(pattern, **kw)]
        assert len(set(scales)) > 10  # grows and backs off many times
        assert 2.0**-60 < min(scales) and max(scales) < 2.0**100  # far from min_scale and fp32's max
        assert set("I-N") <= set(pattern)
    _, pattern, kw = C5.HYSTERESIS_3
    assert 2.0**-40 < min(s for _, s in C5._rule(pattern, **kw))
    _, pattern, kw = C5.CEILING
    scales = [s for _, s in C5._rule(pattern, **kw)]
    assert max(scales) == 2.0**127 and scales.count(2.0**127) > 20  # growth refused there, often


# -- a rule broken: torch's GradScaler doing the work behind the exercise's API

class WrapsGradScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=1, min_scale=1.0):
        self.g = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                      backoff_factor=backoff_factor, growth_interval=growth_interval)

    def scale(self, loss):
        return self.g.scale(loss)

    def get_scale(self):
        return self.g.get_scale()

    def unscale_(self, opt):
        self.g.unscale_(opt)

    def step(self, opt):
        return self.g.step(opt)

    def update(self):
        self.g.update()

    def state_dict(self):
        return self.g.state_dict()

    def load_state_dict(self, state):
        self.g.load_state_dict(state)


def test_05_torchs_gradscaler_inside_scores_0_naming_the_rule(monkeypatch):
    monkeypatch.setitem(G.CHECKS, "05", [c for c in G.checks_of("05") if CHECK5["ranks"] not in c.name])
    r = G.grade("05", overrides=dict(LossScaler=WrapsGradScaler))
    assert r.points == 0, {c.name: c.message for c in r.checks if c.ok}
    for c in r.checks:
        assert "torch.amp.GradScaler was called, which this exercise forbids" in c.message, c.message
