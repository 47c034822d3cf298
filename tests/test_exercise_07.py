"""Exercise 07's grader catches the classic mistakes of Newton-Schulz and distributed
Muon, each in the checks it belongs to; a solution written the way the exercise asks
scores full; and the grader's own oracle of the mistakes holds together (written out,
without a mistake, it is torch.optim.Muon to the bit).

(tests/test_exercises.py proves that the stubs score 0 and minidist scores full.) Each
process launch costs seconds here, so the distributed parts of the plain solution and of
three distributed mistakes run in one launch on 2 ranks (the hang last: nothing after it
runs; the grader's 3 ranks run for minidist in tests/test_exercises.py); the other
mistakes are graded by the single-process checks of the piece they break. The
implementations live at module level: cloudpickle ships them to the ranks by name.
"""

import importlib

import pytest
import torch
import torch.distributed as dist

from exercises import checks_07 as C7
from exercises import grade as G
from grading_helpers import assert_keys_name_each_check_once, failed_checks, message_of
from minidist.muon import Muon as ReferenceMuon

E7 = importlib.import_module("exercises.07_muon")  # its name starts with a digit
A, B, C = C7.COEFFICIENTS


# -- 0. a plain solution, written the way the exercise asks (in its Muon, the given parts)

def plain_ns(G, steps=5, dtype=torch.bfloat16, eps=1e-7, normalise=True, transpose=True,
             per_matrix_norm=True, in_place=False, work_dtype=None):
    """The iteration, with switches for the mistakes below."""
    X = G.to(work_dtype or dtype)
    tall = transpose and X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    shape = X.shape
    X = X.reshape(-1, *shape[-2:])
    if normalise:
        norm = X.norm(dim=(-2, -1), keepdim=True) if per_matrix_norm else X.norm()
        X = X.div_(norm.clamp(min=eps)) if in_place else X / norm.clamp(min=eps)
    for _ in range(steps):
        Gram = torch.bmm(X, X.mT)
        X = torch.baddbmm(X, torch.baddbmm(Gram, Gram, Gram, beta=B, alpha=C), X, beta=A)
    X = X.reshape(shape).to(dtype)
    return X.mT if tall else X


class PlainMuon(E7.Muon):
    def _update(self, p, g):
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - g["momentum"])
        m = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
        return E7.ns_reference(m, g["ns_steps"], self.ns_dtype)

    def _owned(self, world):
        """[(p, group, owner rank)], the owner dealt out round-robin in registration order."""
        items = [(p, g) for g in self.param_groups for p in g["params"]]
        return [(p, g, i % world) for i, (p, g) in enumerate(items)]

    @torch.no_grad()
    def step(self, closure=None):
        rank, world = self._world()
        if world == 1:
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        self._apply(p, self._update(p, g), g)
            return None
        # one all_gather per matrix: the owner's slot holds [flag, update]
        for p, g, owner in self._owned(world):
            send = torch.zeros(1 + p.numel(), dtype=self.ns_dtype)
            if rank == owner and p.grad is not None:
                send[0] = 1
                send[1:] = self._update(p, g).flatten()
            recv = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(recv, send, group=self.group)
            if recv[owner][0] == 1:
                self._apply(p, recv[owner][1:], g)
        return None


# -- Newton-Schulz mistakes

def ns_unnormalised(G, steps=5, dtype=torch.bfloat16, eps=1e-7):
    return plain_ns(G, steps, dtype, eps, normalise=False)


def ns_not_transposed(G, steps=5, dtype=torch.bfloat16, eps=1e-7):
    return plain_ns(G, steps, dtype, eps, transpose=False)


def ns_batch_norm(G, steps=5, dtype=torch.bfloat16, eps=1e-7):  # one norm for the whole batch
    return plain_ns(G, steps, dtype, eps, per_matrix_norm=False)


def ns_in_place(G, steps=5, dtype=torch.bfloat16, eps=1e-7):  # divides the caller's tensor
    return plain_ns(G, steps, dtype, eps, in_place=True)


def ns_in_fp32(G, steps=5, dtype=torch.bfloat16, eps=1e-7):  # fp32 inside, dtype at the end
    return plain_ns(G, steps, dtype, eps, work_dtype=torch.float32)


# -- Muon mistakes, on minidist's Muon with one piece changed

class PlainMomentumMuon(ReferenceMuon):  # nesterov ignored: always buf itself
    def _momentum(self, p, g):  # the matrix minidist's Muon orthogonalises (batched or not)
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        return buf.lerp_(p.grad, 1 - g["momentum"])


class SummedMomentumMuon(ReferenceMuon):  # buf = momentum * buf + grad (torch's docstring)
    def _momentum(self, p, g):
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        buf.mul_(g["momentum"]).add_(p.grad)
        return p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf


class EveryoneMuon(ReferenceMuon):  # every rank orthogonalises everything: right, not sharded
    def _world(self):
        return 0, 1


class NoGatherMuon(PlainMuon):  # each owner applies its own updates, nobody else's
    @torch.no_grad()
    def step(self, closure=None):
        rank, world = self._world()
        for p, g, owner in self._owned(world):
            if rank == owner and p.grad is not None:
                self._apply(p, self._update(p, g), g)


class SkipsCollectiveMuon(PlainMuon):  # the owner of a matrix without gradient skips its all_gather
    @torch.no_grad()
    def step(self, closure=None):
        rank, world = self._world()
        if world == 1:
            return super().step(closure)
        for p, g, owner in self._owned(world):
            if rank == owner and p.grad is None:
                continue
            send = torch.zeros(1 + p.numel(), dtype=self.ns_dtype)
            if rank == owner:
                send[0] = 1
                send[1:] = self._update(p, g).flatten()
            recv = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(recv, send, group=self.group)
            if recv[owner][0] == 1:
                self._apply(p, recv[owner][1:], g)


# The checks of exercise 07, by a word of their names.
CHECK7 = {"singular": "each singular value", "tall": "newton_schulz, tall", "batched": "batched",
          "dtype": "dtype: runs in", "zeros": "zero matrix", "bits": "bit for bit torch's own",
          "one": "Muon, one process", "ranks": "every rank's parameters",
          "state": "momentum only on its owner", "missing": "some gradients None"}

NS_MISTAKES = {
    # name: (newton_schulz, {check that must fail: a phrase its message contains})
    "no normalisation": (ns_unnormalised, {k: "Frobenius norm" for k in
                                           ("singular", "tall", "batched", "dtype", "bits")}),
    "tall matrices not transposed": (ns_not_transposed, {"tall": "wide side", "bits": "to the bit"}),
    "one norm for the whole batch": (ns_batch_norm, {"batched": "not the whole batch's",
                                                     "bits": "relative difference"}),
    "divides G in place": (ns_in_place, {"dtype": "Divide out of place"}),
    "fp32 inside, bf16 at the end": (ns_in_fp32, {"dtype": "computed in fp32", "bits": "to the bit"}),
}
MUON_MISTAKES = {
    "plain momentum where nesterov=True": (PlainMomentumMuon, {"one": "nesterov"}),
    "momentum summed, not averaged": (SummedMomentumMuon, {"one": "lerp_"}),
}


def _failed(result):
    return failed_checks(result, CHECK7)


def _message(messages, key):
    return message_of(messages, CHECK7, key)


def test_07_check_keys_name_each_check_once():
    assert_keys_name_each_check_once("07", CHECK7)


NS_CHECKS = {"singular", "tall", "batched", "dtype", "zeros", "bits"}


def _only(monkeypatch, keys):
    monkeypatch.setitem(G.CHECKS, "07", [c for c in G.checks_of("07")
                                         if any(CHECK7[k] in c.name for k in keys)])


@pytest.mark.parametrize("mistake", list(NS_MISTAKES) + list(MUON_MISTAKES))
def test_07_mistake_loses_the_points_of_its_checks(mistake, monkeypatch):
    # the checks of the broken piece only (the rest is minidist's): Newton-Schulz's, or
    # Muon's in one process (a launch per mistake would cost seconds each)
    if mistake in NS_MISTAKES:
        fn, must_fail = NS_MISTAKES[mistake]
        overrides, checks = dict(newton_schulz=fn), NS_CHECKS
    else:
        cls, must_fail = MUON_MISTAKES[mistake]
        overrides, checks = dict(Muon=cls), {"one"}
    _only(monkeypatch, checks)
    r = G.grade("07", reference=True, overrides=overrides)
    which, messages = _failed(r)
    assert which == set(must_fail), messages
    assert r.points < r.max_points and (r.points > 0 or r.total == len(must_fail))
    for key, phrase in must_fail.items():
        msg = _message(messages, key)
        assert phrase in msg and "not implemented" not in msg, (key, msg)


# module level, so cloudpickle ships them by name
def _plain_full(fns, r, n):
    return C7._part(frozenset(), {"Muon": PlainMuon}, r, n)


def _plain_missing(fns, r, n):
    return C7._part(C7.MISSING, {"Muon": PlainMuon}, r, n)


def _everyone_full(fns, r, n):
    return C7._part(frozenset(), {"Muon": EveryoneMuon}, r, n)


def _everyone_missing(fns, r, n):
    return C7._part(C7.MISSING, {"Muon": EveryoneMuon}, r, n)


def _no_gather_full(fns, r, n):
    return C7._part(frozenset(), {"Muon": NoGatherMuon}, r, n)


def _no_gather_missing(fns, r, n):
    return C7._part(C7.MISSING, {"Muon": NoGatherMuon}, r, n)


def _skips_full(fns, r, n):
    return C7._part(frozenset(), {"Muon": SkipsCollectiveMuon}, r, n)


def _skips_missing(fns, r, n):
    return C7._part(C7.MISSING, {"Muon": SkipsCollectiveMuon}, r, n)


RANK_PARTS = {
    # name: (class, its parts by the grader's part names, {check that must fail: phrase})
    "plain": (PlainMuon, {"full": _plain_full, "missing": _plain_missing}, {}),
    "everyone": (EveryoneMuon, {"full": _everyone_full, "missing": _everyone_missing},
                 {"state": "only its owner"}),
    "no_gather": (NoGatherMuon, {"full": _no_gather_full, "missing": _no_gather_missing},
                  {"ranks": "all_gather", "missing": "all_gather"}),
    "skips": (SkipsCollectiveMuon, {"full": _skips_full, "missing": _skips_missing},
              {"missing": ""}),  # a hang or a mismatch, in gloo's words: see below
}
TIMEOUT_S = 10.0  # the hang's cost; short, but long enough for a busy machine's rendezvous


def test_07_plain_solution_scores_full_and_distributed_mistakes_lose_their_checks(monkeypatch):
    parts = {f"{impl}/{part}": fn for impl, (_, fns, _) in RANK_PARTS.items() for part, fn in fns.items()}
    # one launch, on 2 ranks, the hang last (3 ranks: minidist's, in tests/test_exercises.py)
    results = C7.H.run_all(parts, {}, {2: list(parts)}, TIMEOUT_S, C7.HANG_HINT)
    monkeypatch.setattr(C7, "WORLD_SIZES", (2,))
    failures = {}
    for impl, (cls, _, must_fail) in RANK_PARTS.items():
        mine = {(part, 2): results[f"{impl}/{part}", 2] for part in ("full", "missing")}
        monkeypatch.setattr(C7, "_results", lambda impl_, mine=mine: mine)
        overrides = dict(newton_schulz=plain_ns, Muon=cls)
        r = G.grade("07", overrides=overrides)
        which, failures[impl] = _failed(r)
        assert which == set(must_fail), (impl, failures[impl])
        for key, phrase in must_fail.items():
            assert phrase in _message(failures[impl], key), (impl, key, failures[impl])
    hang = _message(failures["skips"], "missing")
    assert any(w in hang for w in ("timed out", "did not match", "hung")), hang


def test_07_the_stub_is_graded_without_starting_processes(monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a stub needs no launch")
    monkeypatch.setattr(C7.H, "run_all", no_launch)
    r = G.grade("07")
    assert r.points == 0 and all(c.message.startswith("not implemented: ") for c in r.checks)


# -- the grader's oracles

def test_07_the_written_out_muon_is_torch_optim_muon():
    for kw in C7.SINGLE_KW + [C7.DIST_KW]:
        for missing in (frozenset(), C7.MISSING):
            want, _ = C7._torch_muon(tuple(sorted(kw.items())), missing)
            assert C7._first_difference(C7._written_out(kw, missing), want) is None
    # and each mistake it names makes a difference
    kw = C7.SINGLE_KW[0]
    want, _ = C7._torch_muon(tuple(sorted(kw.items())), C7.MISSING)
    for mistake in C7.MISTAKES:
        assert C7._first_difference(C7._written_out(kw, C7.MISSING, mistake), want) is not None, mistake


def test_07_plain_newton_schulz_is_torchs_to_the_bit():
    g = torch.Generator().manual_seed(0)
    for shape in C7.SHAPES:
        G_ = torch.randn(*shape, generator=g)
        assert torch.equal(plain_ns(G_), C7._torch_ns(G_, C7.COEFFICIENTS, 5, 1e-7))


def ns_torchs_own(G_, steps=5, dtype=torch.bfloat16, eps=1e-7):  # a rule broken
    from torch.optim._muon import _zeropower_via_newtonschulz
    return _zeropower_via_newtonschulz(G_.to(dtype), C7.COEFFICIENTS, steps, eps)


def test_07_torchs_newton_schulz_inside_scores_0_naming_the_rule(monkeypatch):
    _only(monkeypatch, NS_CHECKS)
    r = G.grade("07", reference=True, overrides=dict(newton_schulz=ns_torchs_own))
    assert r.points == 0, {c.name: c.message for c in r.checks if c.ok}
    for c in r.checks:
        assert "_zeropower_via_newtonschulz was called, which this exercise forbids" in c.message, \
            c.message
