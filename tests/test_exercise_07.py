"""Exercise 07's grader catches the classic mistakes of Newton-Schulz and distributed
Muon, each in the checks it belongs to; a solution written the way the exercise asks
scores full; and the grader's own oracle of the mistakes holds together (written out,
without a mistake, it is torch.optim.Muon to the bit).

(tests/test_exercises.py proves that the stubs score 0 and the references score full.) Each
process launch costs seconds here, so the distributed parts of the plain solution and of
three distributed mistakes run in one launch on 2 ranks (the hang last: nothing after it
runs; the grader's 3 ranks run for minidist in tests/test_exercises.py); the other
mistakes are graded by the single-process checks of the piece they break. Muon on
shards (part (c)) has its own launch on 2 ranks, under its own rules: a plain solution
with point-to-point messages scores full, one that all-gathers scores 0 naming the rule,
and three mistakes (no momentum, the wrong piece, whole updates broadcast) lose the checks
they break. The implementations live at module level: cloudpickle ships them to the ranks
by name.
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
          "state": "Newton-Schulz only on its owner", "missing": "some gradients None",
          "shards": "the shards put together", "shard_momentum": "momentum whole, on its owner",
          "shard_bytes": "bytes received per rank"}
SHARD_CHECKS = {"shards", "shard_momentum", "shard_bytes"}

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
    "everyone": (EveryoneMuon, {"full": _everyone_full, "missing": _everyone_missing},  # no update travels
                 {"state": "only its owner", "ranks": "all_gather", "missing": "all_gather"}),
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
    _only(monkeypatch, set(CHECK7) - SHARD_CHECKS)  # Muon on shards: its own test below
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


# -- Muon on shards (part (c)): a plain solution with point-to-point messages (the
# reference, exercises/checks_07.py, uses all_to_all_single), and its mistakes

@torch.no_grad()
def plain_shards(param_shard, grad_shard, shapes, owners, momenta, lr=0.02, momentum=0.95,
                 nesterov=True, weight_decay=0.0, ns_steps=5, adjust_lr_fn=None,
                 ns_dtype=torch.bfloat16, group=None, mistake=None):
    rank, n, S = dist.get_rank(group), dist.get_world_size(group), param_shard.numel()
    if mistake == "all-gather":  # every rank gets every shard: what the rule forbids
        whole = grad_shard.new_empty(n * S)
        dist.all_gather_into_tensor(whole, grad_shard, group=group)
    start = [0]
    for a, b in shapes:
        start.append(start[-1] + a * b)

    def piece(i, j):  # matrix i's elements in rank j's shard, in the matrix's coordinates
        a, b = max(start[i], j * S), min(start[i + 1], (j + 1) * S)
        return (a - start[i], b - start[i]) if a < b else None

    def local(i):  # my shard's view of matrix i's piece
        a, b = piece(i, rank)
        return slice(start[i] + a - rank * S, start[i] + b - rank * S)

    works, grads = [], {}
    for i, (rows, cols) in enumerate(shapes):  # (1) gradient pieces to the owners
        if owners[i] == rank:
            grads[i] = g = torch.empty(rows * cols)
            for j in range(n):
                if (pj := piece(i, j)) is not None:
                    if j == rank:
                        g[pj[0]:pj[1]].copy_(grad_shard[local(i)])
                    else:
                        works.append(dist.irecv(g[pj[0]:pj[1]], j, group=group, tag=i))
        elif piece(i, rank) is not None:
            works.append(dist.isend(grad_shard[local(i)].clone(), owners[i], group=group, tag=i))
    for w in works:
        w.wait()
    works, updates, incoming = [], {}, {}
    for i in grads:  # (2) the owner's momentum and Newton-Schulz
        g = grads[i].view(shapes[i])
        if mistake == "no momentum":
            m = g
        else:
            buf = momenta.setdefault(i, torch.zeros_like(g))
            buf.lerp_(g, 1 - momentum)
            m = g.lerp(buf, momentum) if nesterov else buf
        updates[i] = E7.ns_reference(m, ns_steps, ns_dtype).reshape(-1)
    for i in range(len(shapes)):  # (3) the update pieces to the ranks that hold them
        if owners[i] == rank:
            for j in range(n):
                if (pj := piece(i, j)) is not None:
                    a, b = (0, pj[1] - pj[0]) if mistake == "wrong piece" else pj
                    if mistake == "broadcast":  # the whole update, to every rank
                        continue
                    if j == rank:
                        incoming[i] = updates[i][a:b]
                    else:
                        works.append(dist.isend(updates[i][a:b].clone(), j, group=group, tag=100 + i))
        elif mistake != "broadcast" and (pj := piece(i, rank)) is not None:
            incoming[i] = torch.empty(pj[1] - pj[0], dtype=ns_dtype)
            works.append(dist.irecv(incoming[i], owners[i], group=group, tag=100 + i))
    if mistake == "broadcast":
        for i, (rows, cols) in enumerate(shapes):
            u = updates.get(i, torch.empty(rows * cols, dtype=ns_dtype))
            dist.broadcast(u, owners[i], group=group)
            if (pj := piece(i, rank)) is not None:
                incoming[i] = u[pj[0]:pj[1]]
    for w in works:
        w.wait()
    for i, u in incoming.items():  # (4) weight decay and the step, on my pieces
        p = param_shard[local(i)]
        p.mul_(1 - lr * weight_decay)
        p.add_(u, alpha=-E7.adjust_lr(lr, shapes[i], adjust_lr_fn))


def shards_all_gather(*a, **k):
    return plain_shards(*a, mistake="all-gather", **k)


def shards_no_momentum(*a, **k):
    return plain_shards(*a, mistake="no momentum", **k)


def shards_wrong_piece(*a, **k):
    return plain_shards(*a, mistake="wrong piece", **k)


def shards_broadcast(*a, **k):
    return plain_shards(*a, mistake="broadcast", **k)


def _shards_plain(fns, r, n):
    return C7._shards_part({"muon_step_on_shards": plain_shards}, r, n)


def _shards_all_gather(fns, r, n):
    return C7._shards_part({"muon_step_on_shards": shards_all_gather}, r, n)


def _shards_no_momentum(fns, r, n):
    return C7._shards_part({"muon_step_on_shards": shards_no_momentum}, r, n)


def _shards_wrong_piece(fns, r, n):
    return C7._shards_part({"muon_step_on_shards": shards_wrong_piece}, r, n)


def _shards_broadcast(fns, r, n):
    return C7._shards_part({"muon_step_on_shards": shards_broadcast}, r, n)


RULE = "was called, which this exercise forbids: Muon on shards sends each owner only"
SHARD_PARTS = {
    # name: (function, its part, {check that must fail: a phrase its message contains})
    "plain": (plain_shards, _shards_plain, {}),
    "all-gather": (shards_all_gather, _shards_all_gather,
                   {k: RULE for k in SHARD_CHECKS}),
    "no momentum": (shards_no_momentum, _shards_no_momentum,
                    {"shards": "raw gradient", "shard_momentum": "keeps no momenta"}),
    "wrong piece": (shards_wrong_piece, _shards_wrong_piece,
                    {"shards": "where the layout puts it"}),
    "broadcast": (shards_broadcast, _shards_broadcast, {"shard_bytes": "'broadcast'"}),
}


def test_07_shards_plain_solution_scores_full_and_mistakes_lose_their_checks(monkeypatch):
    # one launch on 2 ranks, under the part's rules (3 ranks: the reference's, in
    # tests/test_exercises.py)
    parts = {name: part for name, (_, part, _) in SHARD_PARTS.items()}
    results = C7.H.run_all(parts, {}, {2: list(parts)}, TIMEOUT_S, C7.SHARD_HANG_HINT, C7.SHARD_RULES)
    monkeypatch.setattr(C7, "WORLD_SIZES", (2,))
    _only(monkeypatch, SHARD_CHECKS)
    for name, (fn, _, must_fail) in SHARD_PARTS.items():
        mine = {("shards", 2): results[name, 2]}
        monkeypatch.setattr(C7, "_shards_results", lambda impl_, mine=mine: mine)
        r = G.grade("07", overrides=dict(muon_step_on_shards=fn))
        which, failures = _failed(r)
        assert which == set(must_fail), (name, failures)
        for key, phrase in must_fail.items():
            assert phrase in _message(failures, key), (name, key, failures)
        if name == "all-gather":  # the rule: 0 on every check of the part, naming the API
            assert r.points == 0 and all("dist.all_gather_into_tensor" in c.message for c in r.checks)
    # the bound is tight: exact pieces (fp32 gradients, bf16 updates) are what the counter
    # counts, to the byte, and each piece outside its owner's shard travels once each way
    need = C7._must_receive(2)
    assert sum(g for g, _ in need) == sum(u for _, u in need) > 0
    got = [sum(res["received"].values()) for res in results["plain", 2][1]]
    assert got == [C7.SHARD_STEPS * (4 * g + 2 * u) for g, u in need], (got, need)
