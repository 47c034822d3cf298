"""Graded checks of exercise 07 (exercises/07_muon.py): newton_schulz, Muon and Muon on shards against torch's
own (the scalar polynomial, FlopCounterMode, torch.optim.Muon), each rank's share of momenta, FLOPs, bytes."""

import functools
import math

import torch
import torch.distributed as dist
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns
from torch.utils import flop_counter

from exercises.grader import Cache, Rules, check, differ, events, first_problem, per_world_size, run_all
from exercises.grader.rules import METHODS

_ORACLE = "exercise 07 writes Newton-Schulz and Muon: torch's are the grader's oracles"
RULES = Rules(forbidden={"torch.optim:Muon": _ORACLE, "torch.optim._muon:_zeropower_via_newtonschulz": _ORACLE})
_YOURS = "part (a) is yours to write: minidist's newton_schulz (ns_reference) is for (b) and (c)"
NS_RULES = Rules(forbidden={**RULES.forbidden, **{f"minidist.muon.{k}": _YOURS for k in (
    "orthogonalize:newton_schulz", "orthogonalize:newton_schulz_many", "plain:newton_schulz")}})
SHARD_RULES = Rules(frozenset(m for m in METHODS.values() if not m.startswith("all_gather")),
                    "no all-gather of any kind in Muon on shards: it would hand every rank every shard, "
                    "which is what ZeRO avoids (send each rank its own pieces)", RULES.forbidden)

COEFFICIENTS, WORLD_SIZES = (3.4445, -4.7750, 2.0315), (2, 3)
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung
HANG_HINT = ("Every rank joins every collective of a step, in the same order and with the same sizes: "
             "the owner of a matrix without a gradient too, and a rank that owns nothing.")


def _mats(shapes, seed):  # in (b) and (c): seed 0 the parameters, 100 + t the gradients of step t
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def _form(what, O, shape, dtype=None):  # O, once it is a finite tensor of `shape` (and `dtype`)
    form = f"{O.dtype} of shape {tuple(O.shape)}" if isinstance(O, torch.Tensor) else type(O).__name__
    assert isinstance(O, torch.Tensor) and tuple(O.shape) == tuple(shape) and dtype in (None, O.dtype), \
        f"{what} returned {form}, want {dtype or 'a tensor'} of shape {tuple(shape)}"
    assert bool(torch.isfinite(O).all()), f"{what} holds inf or NaN"
    return O


def _flops(do):  # do()'s result, and its FLOPs of matrix products (torch's FlopCounterMode)
    with flop_counter.FlopCounterMode(display=False) as counter:
        return do(), counter.get_total_flops()


# ------------------------------------------------------------------ (a) newton_schulz
NS = dict(rules=NS_RULES, hints=[
    "What does X <- a X + b (X X^T) X + c (X X^T)^2 X do to a singular value s of X, and why must every s "
    "start in [0, 1]?",
    "Convert G to dtype, divide by its Frobenius norm clamped below by eps, then `steps` times A = X X^T, "
    "B = b A + c A A, X = a X + B X. Tall: work on X^T. A batch: each by its own norm.",
    "torch's bits: the norm taken in dtype, B and X as fused multiply-adds (torch.baddbmm on a (batch, m, n) "
    "view, torch.addmm on a matrix), nothing done in place to the caller's G."])


def _ns(impl, G, of="G", **kw):  # impl.newton_schulz(G, **kw) and the call in words, once _form passes it
    what = f"newton_schulz({of} of shape {tuple(G.shape)}{''.join(f', {k}={v}' for k, v in kw.items())})"
    return _form(what, impl.newton_schulz(G, **kw), G.shape, kw.get("dtype", torch.bfloat16)), what


@check("07", 3, **NS, name="newton_schulz, fp32: each singular value s -> p^k(s / ||G||_F), U and V kept")
def _singular_values(impl):
    for (m, n), steps in [((48, 96), 5), ((64, 64), 5), ((40, 72), 2)]:
        g, k = torch.Generator().manual_seed(m + n), min(m, n)
        U, V = (torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0] for d in (m, n))
        want = (s := 3 * torch.logspace(-3, 0, k, dtype=torch.float64)) / s.norm()  # the norm must go
        O, what = _ns(impl, ((U * s) @ V.T).float(), steps=steps, dtype=torch.float32)
        for a, b, c in [COEFFICIENTS] * steps:
            want = a * want + b * want ** 3 + c * want ** 5
        core = U.T @ O.double() @ V  # diagonal, holding p^k(s / ||G||_F), if U and V are kept
        got, outside = core.diagonal(), (O.double() - U @ core @ V.T).abs().max().item()
        # fp32: a few roundings of 2^-24 per product of <= 96 terms, over 5 steps
        bad = ((got - want).abs() > 2e-5 + 1e-4 * want.abs()).nonzero().flatten().tolist()
        assert not bad, (f"{what}: G's singular value {s[bad[0]]:.4g} became {got[bad[0]]:.6g}, want "
                         f"p^{steps}({s[bad[0]]:.4g} / ||G||_F) = {want[bad[0]]:.6g}")
        assert (off := (core - torch.diag(got)).abs().max().item()) < 2e-5 and outside < 1e-4, (
            f"{what}: U^T O V is off-diagonal by up to {off:.3g} and O has {outside:.3g} outside "
            "G's row and column spaces: the singular vectors are not G's")


@check("07", 1, **NS, name="newton_schulz, tall: the transpose of the wide case, with its FLOPs")
def _tall(impl):
    for G in (_mats([(m, n)], m)[0] for m, n in [(96, 48), (80, 16)]):
        (O, what), flops = _flops(lambda: _ns(impl, G, dtype=torch.float32))
        (OT, _), flops_T = _flops(lambda: _ns(impl, G.T.contiguous(), dtype=torch.float32))
        err = (O - OT.T).abs().max().item()
        assert err <= 1e-4, f"{what} differs from newton_schulz(G.T).T by up to {err:.3g}"
        assert 0 < flops <= 1.01 * flops_T, (f"{what} took {flops:,} FLOPs of matrix products (torch's "
                                             f"FlopCounterMode), newton_schulz(G.T) {flops_T:,}")


@check("07", 1, **NS, name="newton_schulz, batched: each matrix of the leading dimensions on its own")
def _batched(impl):
    for shape in [(2, 3, 16, 24), (4, 24, 16)]:  # norms from 0.01 to 100: each matrix needs its own
        G = _mats([shape], len(shape))[0] * torch.logspace(-2, 2, math.prod(shape[:-2])).view(*shape[:-2], 1, 1)
        O, what = _ns(impl, G, "a batch", dtype=torch.float32)
        for k, (Gk, Ok) in enumerate(zip(G.reshape(-1, *shape[-2:]), O.reshape(-1, *shape[-2:]))):
            err = (Ok - _ns(impl, Gk, f"matrix {k} of the batch alone", dtype=torch.float32)[0]).abs().max()
            assert err <= 1e-5, (f"{what}: matrix {k} (norm {Gk.norm():.3g}) differs from "
                                 f"newton_schulz of it alone by up to {err:.3g}")


@check("07", 2, **NS, name="newton_schulz, dtype and eps: returns dtype (bf16 by default), G unchanged, "
                           "zeros for zeros")
def _dtype_and_zeros(impl):
    G, Z = _mats([(48, 96)], 3)[0], torch.stack([torch.zeros(6, 10), *_mats([(6, 10)], 5)])
    fp32 = dict(dtype=torch.float32)
    for X, kw in [(G, {}), (G, fp32), (G.double(), fp32), (G.bfloat16(), dict(steps=3)),
                  (torch.zeros(8, 4), {}), (torch.zeros(2, 5, 5), {}), (Z, fp32)]:
        of = f"{'G' if X.any() else 'zeros'}{', a zero matrix first,' if X is Z else ''} in {X.dtype}"
        before, (O, what) = X.clone(), _ns(impl, X, of, **kw)
        assert torch.equal(X, before), (f"{what} changed its input G, by up to "
                                        f"{(X.double() - before.double()).abs().max():.3g}")
        zero = O[0] if X is Z else O if not X.any() else O[:0]
        assert not zero.any(), f"{what}: the zero matrix gave {int(zero.count_nonzero())} non-zeros"


@check("07", 1, **NS, name="newton_schulz, bf16: bit for bit torch's own (torch.optim._muon)")
def _bitwise(impl):
    for G, steps in zip(_mats([(48, 96), (96, 48), (64, 64), (7, 130), (3, 32, 48)], 6), [5, 5, 5, 3, 5]):
        O, what = _ns(impl, G, steps=steps)
        want = torch.stack([torch_ns(g, COEFFICIENTS, steps, 1e-7)
                            for g in G.reshape(-1, *G.shape[-2:])]).reshape(G.shape)
        rel = ((O.float() - want.float()).norm() / want.float().norm()).item()
        assert torch.equal(O, want), (f"{what}: {int((O != want).sum())} of {O.numel()} elements "
                                      f"differ from torch's (relative difference {rel:.3g})")


# ------------------------------------------------------------------ (b) Muon
SHAPES = [(32, 64), (64, 32), (48, 48), (16, 96), (96, 16), (24, 40), (40, 24)]  # 3 ranks: rounds of 3, 3, 1
STEPS, MISSING = 4, frozenset({(1, 2), (2, 2), (2, 5)})  # (step, matrix) without a gradient
DEFAULTS = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5, adjust_lr_fn=None)
SINGLE_KW = [dict(lr=0.01, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"),
             dict(weight_decay=0.1), dict(lr=0.05, weight_decay=0.01, adjust_lr_fn="original", ns_steps=3)]
DIST_KW = dict(weight_decay=0.1)
_DIST_HINTS = ["On N ranks, how can every rank know, without asking, which rank owns each matrix?",
               "Deal the matrices by cost, largest first, in rounds of N: rank r owns the r-th of each "
               "round. Only the owner runs _update; one all_gather per round hands out the updates.",
               "Each rank's slot of a round is [flag, update, padding] in ns_dtype, the round's largest "
               "matrix long: flag 0 means 'no update', so every rank joins every all_gather, same size."]


def _drive(cls, kw, missing, shapes=SHAPES, steps=STEPS, step=lambda do: do()):  # trajectory, momenta, state
    opt, trajectory = cls(ps := [torch.nn.Parameter(m) for m in _mats(shapes, 0)], **{**DEFAULTS, **kw}), []
    for t in range(steps):
        for i, (p, grad) in enumerate(zip(ps, _mats(shapes, 100 + t))):
            p.grad = None if (t, i) in missing else grad
        step(opt.step)
        trajectory.append([p.detach().clone() for p in ps])
    states = [opt.state.get(p, {}) for p in ps]  # .get: reading creates no state
    return trajectory, {i: s["momentum_buffer"].clone() for i, s in enumerate(states)
                        if isinstance(s.get("momentum_buffer"), torch.Tensor)}, states


@functools.lru_cache(maxsize=None)  # torch.optim.Muon's (parameters after each step, momentum buffers)
def _oracle(missing=frozenset(), kw=tuple(DIST_KW.items()), shapes=tuple(SHAPES), steps=STEPS):
    return _drive(torch.optim.Muon, dict(kw), missing, list(shapes), steps)[:2]


def _same(where, got, missing, kw=tuple(DIST_KW.items())):  # == torch.optim.Muon's, each step, to the bit
    for t, (gs, ws) in enumerate(zip(got, _oracle(missing, kw)[0])):
        for i, (g, w) in enumerate(zip(gs, ws)):
            still = torch.equal(g, got[t - 1][i] if t else _mats(SHAPES, 0)[i])
            assert torch.equal(g, w), (f"{where}, after step {t + 1}, matrix {i} {tuple(w.shape)}"
                                       f"{' (no gradient at this step)' if (t, i) in missing else ''}: "
                                       f"{'did not move, ' if still else ''}up to {(g - w).abs().max():.3g} "
                                       f"from one process's torch.optim.Muon (largest {w.abs().max():.3g})")


@check("07", 3, name="Muon, one process: == torch.optim.Muon to the bit (nesterov, decay, lr rule)", hints=[
    "In which order does torch.optim.Muon update the momentum, look ahead (Nesterov), orthogonalise, decay and "
    "step? (chapter 07, section 3)",
    "_update: buf = self.state[p]['momentum_buffer'] (zeros at first), buf.lerp_(grad, 1 - momentum), "
    "grad.lerp(buf, momentum) with Nesterov (else buf), Newton-Schulz in self.ns_dtype; self._apply decays and "
    "steps. No gradient: skip the parameter."])
def _one_process(impl):
    missing = frozenset({(1, 2), (2, 5)})
    for kw in SINGLE_KW:
        _same(f"Muon(**{kw})", _drive(impl.Muon, kw, missing)[0], missing, tuple(kw.items()))


def _muon_part(missing, fns, r, n):  # on each rank: Muon's parameters, momenta, each step's FLOPs, bytes sent
    def step(do):
        seen = len(events())
        flops.append(_flops(do)[1])
        sent.append(sum(e.sent for e in events()[seen:]))
    flops, sent = [], []
    trajectory, momentum, states = _drive(fns["Muon"], DIST_KW, missing, step=step)
    held = sum(v.numel() * v.element_size() for s in states for v in s.values() if isinstance(v, torch.Tensor))
    return dict(trajectory=trajectory, momentum=momentum, flops=flops, sent=sent, held=held)


def _ranks(impl, name, part):  # (n, each rank's result of `part`) at each n; run once per implementation
    fn, (cache, parts, rules) = getattr(impl, name), PARTS[name]
    return per_world_size(cache.get((fn, WORLD_SIZES, TIMEOUT_S), lambda: run_all(
        parts, {name: fn}, WORLD_SIZES, TIMEOUT_S, HANG_HINT, rules)), part, WORLD_SIZES)


@check("07", 3, name="2 and 3 ranks: every rank's parameters == one process's after every step",
       hints=_DIST_HINTS)
def _distributed(impl):
    for n, per_rank in _ranks(impl, "Muon", "full"):
        for r, res in enumerate(per_rank):
            _same(f"on {n} ranks, rank {r}", res["trajectory"], frozenset())


@check("07", 2, name="2 and 3 ranks, some gradients None: every rank joins every collective, right result",
       hints=["What does the owner of a matrix without a gradient put into that round's all_gather?",
              HANG_HINT, _DIST_HINTS[2]])
def _missing_grads(impl):
    for n, per_rank in _ranks(impl, "Muon", "missing"):
        for r, res in enumerate(per_rank):
            _same(f"on {n} ranks, rank {r}", res["trajectory"], MISSING)


@check("07", 3, name="2 and 3 ranks: one owner per matrix; each rank's momentum, Newton-Schulz FLOPs "
                     "and updates sent about 1/N", hints=_DIST_HINTS)
def _ownership(impl):
    sizes = [a * b for a, b in SHAPES]
    for n, per_rank in _ranks(impl, "Muon", "full"):
        for i, want in _oracle(frozenset())[1].items():
            keep = [r for r, res in enumerate(per_rank) if i in res["momentum"]]
            assert len(keep) == 1, f"on {n} ranks, matrix {i}'s momentum_buffer is on ranks {keep}, want one"
            first_problem([differ(f"on {n} ranks, rank {keep[0]}: matrix {i}'s momentum_buffer",
                                  per_rank[keep[0]]["momentum"][i], want, "torch.optim.Muon's", 0, 0)])
        share = sum(sizes) / n + max(sizes)  # elements: 1/N of them, and padding to the largest
        for r, res in enumerate(per_rank):
            assert res["held"] <= 4 * share, (f"on {n} ranks, rank {r}'s optimizer state holds {res['held']} "
                                              f"bytes, over 1/{n} of the momenta + the largest (fp32)")
            mine = sorted(res["momentum"])  # Newton-Schulz on the wide side: X X^T, A A, B X
            need = sum(5 * (4 * min(SHAPES[i]) ** 2 * max(SHAPES[i]) + 2 * min(SHAPES[i]) ** 3) for i in mine)
            for t, (flops, sent) in enumerate(zip(res["flops"], res["sent"])):
                at = f"on {n} ranks, rank {r}, step {t + 1}:"
                assert flops == need, (f"{at} {flops:,} FLOPs of matrix products (FlopCounterMode); the "
                                       f"Newton-Schulz of the matrices it keeps momenta of, {mine}: {need:,}")
                assert sent <= 2 * (share + len(sizes)), (f"{at} its collectives sent {sent} bytes, over 1/{n} "
                                                          "of the updates + the largest + a flag each (bf16)")


# ------------------------------------------------------------------ (c) Muon on shards
SHARD_SHAPES = [(24, 40), (40, 24), (33, 31), (16, 56), (48, 20)]  # padded at 2 and 3 ranks, straddling shards
START = [sum(a * b for a, b in SHARD_SHAPES[:i]) for i in range(len(SHARD_SHAPES) + 1)]
OWNERS = {2: [1, 1, 0, 0, 0], 3: [1, 2, 0, 0, 1]}  # each owner holds little or none of its matrices
SHARD_STEPS, SHARD_KW = 3, dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
# of how far a matrix moved: bf16 rounds an update by up to 2^-8 = 0.4% (exact pieces give torch's bits)
SHARD_TOL, MOMENTUM_TOL = 0.01, 1e-5  # the fp32 momentum: a few roundings of 2^-24
SHARD_HINTS = ["Where does matrix i lie? start[i] = the sum of the earlier rows x cols; rank j holds "
               "[j*S, (j+1)*S): its piece of matrix i is the overlap.",
               "Gradient pieces go to each matrix's owner, which puts it together, keeps its momentum and "
               "runs Newton-Schulz; the pieces of the update go back to the ranks that hold them.",
               "dist.all_to_all_single with split sizes (or isend/irecv) sends each rank exactly its "
               "pieces, gradients in fp32, updates in ns_dtype; every size follows from shapes and owners."]


def _shards_part(fns, r, n):  # on each rank: SHARD_STEPS steps; its shard and bytes received each step
    S = math.ceil(START[-1] / n)  # flattened, concatenated, padded to n * S: rank r holds [r*S, (r+1)*S)
    of = lambda seed: torch.cat([*(m.reshape(-1) for m in _mats(SHARD_SHAPES, seed)),  # noqa: E731
                                 torch.zeros(n * S - START[-1])])[r * S:(r + 1) * S].clone()
    shard, momenta, trajectory, received = of(0), {}, [], []
    for t in range(SHARD_STEPS):
        seen = len(events())
        fns["muon_step_on_shards"](shard, of(100 + t), list(SHARD_SHAPES), list(OWNERS[n]), momenta, **SHARD_KW)
        trajectory.append(shard.clone())
        received.append(sum(e.received for e in events()[seen:]))
    return dict(trajectory=trajectory, received=received, momenta={
        i: v.detach().clone() if isinstance(v, torch.Tensor) else v for i, v in momenta.items()})


PARTS = {"Muon": (Cache(), {"full": functools.partial(_muon_part, frozenset()),
                            "missing": functools.partial(_muon_part, MISSING)}, RULES),
         "muon_step_on_shards": (Cache(), {"shards": _shards_part}, SHARD_RULES)}  # (results, parts, rules)
SHARD_RUN = frozenset(), tuple(SHARD_KW.items()), tuple(SHARD_SHAPES), SHARD_STEPS  # _oracle's arguments


@check("07", 3, name="Muon on shards, 2 and 3 ranks: the shards put together == torch.optim.Muon on the "
                     "whole matrices (within 1% of the movement: bf16)", hints=SHARD_HINTS, rules=SHARD_RULES)
def _shards_equal(impl):
    start = [m.reshape(-1) for m in _mats(SHARD_SHAPES, 0)]
    for n, per_rank in _ranks(impl, "muon_step_on_shards", "shards"):
        S = math.ceil(START[-1] / n)
        for t, want in enumerate(_oracle(*SHARD_RUN)[0]):
            flat = torch.cat([res["trajectory"][t].float().reshape(-1) for res in per_rank])
            assert flat.numel() == n * S, f"on {n} ranks the shards hold {flat.numel()} elements, want {n * S}"
            for i, shape in enumerate(SHARD_SHAPES):
                got, w = flat[START[i]:START[i + 1]], want[i].reshape(-1)
                moved, err = (w - start[i]).abs().max().item(), (got - w).abs().nan_to_num(math.inf)
                k = int(err.argmax())
                assert err[k] <= SHARD_TOL * moved, (
                    f"on {n} ranks (owners {OWNERS[n]}), after step {t + 1}, matrix {i} {shape}: element {k}, "
                    f"on rank {(START[i] + k) // S}, is {got[k]:.6g}, torch.optim.Muon's {w[k]:.6g} "
                    f"({err[k] / moved:.3g} of how far the matrix moved; {SHARD_TOL} allowed)")


@check("07", 2, name="Muon on shards: each matrix's momentum whole, on its owner only",
       hints=SHARD_HINTS[:2], rules=SHARD_RULES)
def _shards_momentum(impl):
    for n, per_rank in _ranks(impl, "muon_step_on_shards", "shards"):
        want = _oracle(*SHARD_RUN)[1]
        for r, res in enumerate(per_rank):
            mine, kept = [i for i, o in enumerate(OWNERS[n]) if o == r], sorted(res["momenta"], key=str)
            assert kept == mine, f"on {n} ranks (owners {OWNERS[n]}), rank {r} keeps momenta {kept}, not {mine}"
            for i in mine:
                top, what = want[i].abs().max(), f"on {n} ranks, rank {r}: momenta[{i}]"
                err = (_form(what, res["momenta"][i], want[i].shape).float() - want[i]).abs().max().item()
                assert err <= MOMENTUM_TOL * top, (f"{what} after {SHARD_STEPS} steps is up to {err:.3g} from "
                                                   f"torch.optim.Muon's momentum_buffer (largest {top:.3g})")


@check("07", 2, name="Muon on shards: bytes received per rank and step <= its pieces (gradients fp32, "
                     "updates bf16) + 64 per matrix", hints=SHARD_HINTS, rules=SHARD_RULES)
def _shards_bytes(impl):
    for n, per_rank in _ranks(impl, "muon_step_on_shards", "shards"):
        owners, S, k = OWNERS[n], math.ceil(START[-1] / n), range(len(SHARD_SHAPES))
        size = lambda i, j: max(0, min(START[i + 1], (j + 1) * S) - max(START[i], j * S))  # noqa: E731
        for r, res in enumerate(per_rank):
            # its matrices' gradient pieces from the others (fp32), the others' update pieces in its shard
            # (bf16), its own in its shard both ways (what an all-to-all sends a rank itself)
            g = sum(size(i, j) for i in k for j in range(n) if owners[i] == r != j)
            u, x = (sum(size(i, r) for i in k if (owners[i] == r) == own) for own in (False, True))
            low, high = 4 * g + 2 * u, 4 * g + 2 * u + 6 * x + 64 * len(k)
            for t, got in enumerate(res["received"]):
                assert low <= got <= high, (f"on {n} ranks (owners {owners}), rank {r}, step {t + 1}: received "
                                            f"{got} bytes; its pieces: {g} gradient elements (fp32) from the "
                                            f"others, {u} update elements (bf16) from the owners, {x} of its "
                                            f"own: {low} to {high}")


@torch.no_grad()
def reference_muon_step_on_shards(param_shard, grad_shard, shapes, owners, momenta, lr=0.02, momentum=0.95,
                                  nesterov=True, weight_decay=0.0, ns_steps=5, adjust_lr_fn=None,
                                  ns_dtype=torch.bfloat16, group=None):
    """Exercise 07 (c)'s reference, its pieces sent by minidist.comm's exchange (default group)."""
    from minidist.comm import _exchange
    from minidist.muon import adjust_lr, newton_schulz
    r, n, S, k = dist.get_rank(group), dist.get_world_size(group), param_shard.numel(), range(len(shapes))
    st = [sum(a * b for a, b in shapes[:i]) for i in range(len(shapes) + 1)]

    def of(t, i, j, base):  # t's view of matrix i's piece in rank j's shard (t starts at `base`)
        lo = max(st[i], j * S)
        return t[lo - base:max(lo, min(st[i + 1], (j + 1) * S)) - base]

    def swap(pieces):  # pieces(j) = (what goes to rank j, where what comes from rank j goes)
        for d in range(n):  # to rank r + d, from rank r - d (d = 0: this rank's own pieces, copied)
            dst, src = (r + d) % n, (r - d) % n
            out, into = [t for t in pieces(dst)[0] if t.numel()], [v for v in pieces(src)[1] if v.numel()]
            buf = torch.empty(sum(v.numel() for v in into), dtype=into[0].dtype) if d and into else None
            if d:
                _exchange(torch.cat(out) if out else None, dst, buf, src, "shards", "pieces")
            for v, part in zip(into, out if buf is None else buf.split([v.numel() for v in into])):
                v.copy_(part)
    mine = [i for i in k if owners[i] == r]
    whole = {i: grad_shard.new_zeros(shapes[i][0] * shapes[i][1]) for i in mine}
    got = {i: torch.zeros(of(param_shard, i, r, r * S).numel(), dtype=ns_dtype) for i in k}
    swap(lambda j: ([of(grad_shard, i, r, r * S) for i in k if owners[i] == j],
                    [of(whole[i], i, j, st[i]) for i in mine]))
    for i in mine:  # the gradient, then the update, of matrix i
        g = whole[i].view(shapes[i])
        buf = momenta.setdefault(i, torch.zeros_like(g)).lerp_(g, 1 - momentum)
        whole[i] = newton_schulz(g.lerp(buf, momentum) if nesterov else buf, ns_steps, ns_dtype).reshape(-1)
    swap(lambda j: ([of(whole[i], i, j, st[i]) for i in mine], [got[i] for i in k if owners[i] == j]))
    for i in k:
        p = of(param_shard, i, r, r * S)
        p.mul_(1 - lr * weight_decay).add_(got[i], alpha=-adjust_lr(lr, shapes[i], adjust_lr_fn))
