"""Graded checks of exercise 07 (exercises/07_muon.py), registered with exercises.grade.

newton_schulz is checked in this process against oracles that share none of its code:
the scalar polynomial it must apply to each singular value of a matrix built here with
known singular vectors and values (fp32), its own answers for the transpose, for each
matrix of a batch alone and for zero matrices, a FLOP count (torch.utils.flop_counter)
that says on which side it iterates, and torch's own Newton-Schulz
(torch.optim._muon._zeropower_via_newtonschulz), bit for bit in bf16.

Muon in one process is compared with torch.optim.Muon, bit for bit (the same bf16
arithmetic); a wrong answer is compared with a few classic mistakes, written out here
(_written_out), to say which one it makes. Distributed Muon runs where it must: in 2 and
3 processes started by minidist.launch.launch (gloo), one launch per world size for every
part (see exercises/_harness.py); every rank's parameters after every step are compared
with torch.optim.Muon's, run here, and every rank reports which momentum it holds.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as _torch_ns_itself
from torch.utils.flop_counter import FlopCounterMode

from exercises import _harness as H
from exercises import _rules
from exercises.grade import check

# The exercise's rules, watched in every check and part while the learner's code runs
# (exercises/_rules.py): torch's Muon and its Newton-Schulz are the grader's oracles.
_ORACLE = "exercise 07 writes Newton-Schulz and Muon: torch's are the grader's oracles"
RULES = _rules.Rules(apis={"torch.optim.Muon": _ORACLE,
                           "torch.optim._muon._zeropower_via_newtonschulz": _ORACLE})


def _torch_ns(*args):
    """torch's Newton-Schulz, the oracle (exempt from the rules it enforces)."""
    with _rules.exempt():
        return _torch_ns_itself(*args)


COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's, as torch.optim.Muon's
WORLD_SIZES = (2, 3)
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung; tests lower it
HANG_HINT = ("Every rank must join every all_gather of a step, in the same order and with "
             "the same sizes: the owner of a matrix without a gradient too (send a flag that "
             "says 'no update'), and a rank that owns nothing in a round.")

# Muon's parameters: wide, tall and square, 7 of them, so that 3 ranks deal out rounds of
# 3, 3 and 1 (two ranks own nothing in the last round)
SHAPES = [(32, 64), (64, 32), (48, 48), (16, 96), (96, 16), (24, 40), (40, 24)]
STEPS = 4
# (step, matrix) pairs without a gradient: matrix 2 at step 1; at step 2 the largest matrix
# (its owner's first round) and a small one (a later round)
MISSING = frozenset({(1, 2), (2, 2), (2, 5)})
SINGLE_KW = [  # one process, against torch.optim.Muon
    dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1),
    dict(lr=0.01, momentum=0.9, nesterov=False, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"),
    dict(lr=0.05, momentum=0.95, nesterov=True, weight_decay=0.01, adjust_lr_fn="original", ns_steps=3),
]
DIST_KW = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)


# --------------------------------------------------------------------- Newton-Schulz oracles

def _poly(s: np.ndarray, steps: int) -> np.ndarray:
    """What `steps` steps of the iteration do to each singular value, in float64."""
    a, b, c = COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


@functools.lru_cache(maxsize=None)
def _singular_vectors(m: int, n: int, seed: int):
    """Random orthonormal U (m x k) and V (n x k), k = min(m, n), float64."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, min(m, n), generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, min(m, n), generator=g, dtype=torch.float64))
    return U, V


def _with_singular_values(s: np.ndarray, m: int, n: int, seed: int = 0):
    """G = U diag(s) V^T (float64) with known singular vectors U and V."""
    U, V = _singular_vectors(m, n, seed)
    return (U * torch.as_tensor(s)) @ V.T, U, V


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _shape_problem(what: str, got, want_shape) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{what} returned {type(got).__name__}, want a tensor"
    if tuple(got.shape) != tuple(want_shape):
        return f"{what} returned shape {tuple(got.shape)}, want {tuple(want_shape)} (the input's)"
    return None


def _finite_problem(what: str, O: torch.Tensor, G: torch.Tensor) -> str | None:
    if bool(torch.isfinite(O).all()):
        return None
    return (f"{what} holds inf or NaN (G's Frobenius norm is {G.double().norm():.3g}): divide X by "
            "its Frobenius norm, clamped below by eps, before the iteration, so that every "
            "singular value starts in [0, 1]")


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# --------------------------------------------------------------------- Muon: data and oracles

def _params(shapes=SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _grads(t: int, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(*s, generator=g) for s in shapes]


def _drive(make, missing=frozenset()):
    """STEPS steps of the optimizer make(params) on seeded gradients, the (step, matrix)
    pairs of `missing` without one; (parameters after each step, optimizer, parameters)."""
    ps = _params()
    opt = make(ps)
    trajectory = []
    for t in range(STEPS):
        for i, (p, grad) in enumerate(zip(ps, _grads(t))):
            p.grad = None if (t, i) in missing else grad
        opt.step()
        trajectory.append([p.detach().clone() for p in ps])
    return trajectory, opt, ps


@functools.lru_cache(maxsize=None)
def _torch_muon(kw_items: tuple, missing: frozenset):
    """torch.optim.Muon's (parameters after each step, final momentum per matrix)."""
    with _rules.exempt():  # the grader's oracle
        trajectory, opt, ps = _drive(lambda ps: torch.optim.Muon(ps, **dict(kw_items)), missing)
    momentum = {i: opt.state[p]["momentum_buffer"] for i, p in enumerate(ps) if p in opt.state}
    return trajectory, momentum


def _lr_factor(shape, how) -> float:
    rows, cols = shape
    if how in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


@torch.no_grad()
def _written_out(kw: dict, missing: frozenset, mistake: str | None = None):
    """Muon written out (torch.optim.Muon's arithmetic; tests/test_exercise_07.py proves it
    equal), or with one classic mistake, to name the mistake a wrong answer makes."""
    lr, mu, wd = kw["lr"], kw["momentum"], kw["weight_decay"]
    nesterov = kw["nesterov"] != (mistake == "nesterov flipped")
    ps, bufs, trajectory = [p.detach() for p in _params()], {}, []
    for t in range(STEPS):
        for i, (p, grad) in enumerate(zip(ps, _grads(t))):
            if (t, i) in missing:
                continue
            buf = bufs.setdefault(i, torch.zeros_like(p))
            if mistake == "momentum summed":
                buf.mul_(mu).add_(grad)
            else:
                buf.lerp_(grad, 1 - mu)
            m = grad.lerp(buf, mu) if nesterov else buf
            update = _torch_ns(m, COEFFICIENTS, kw.get("ns_steps", 5), 1e-7)
            if mistake != "no weight decay":
                p.mul_(1 - lr * wd)
            factor = 1.0 if mistake == "lr not adjusted" else _lr_factor(p.shape, kw.get("adjust_lr_fn"))
            p.add_(update, alpha=-(lr * factor))
        trajectory.append([p.clone() for p in ps])
    return trajectory


MISTAKES = {
    "nesterov flipped": "with nesterov=True the update is the Nesterov look-ahead "
                        "p.grad.lerp(buf, momentum), with nesterov=False buf itself: yours "
                        "has them the other way round (or ignores the flag)",
    "momentum summed": "the momentum is an average, buf.lerp_(p.grad, 1 - momentum) "
                       "(momentum * buf + (1 - momentum) * grad), not momentum * buf + grad",
    "no weight decay": "weight decay was not applied: p.mul_(1 - lr * weight_decay) before the "
                       "step (self._apply does both)",
    "lr not adjusted": "the learning rate was not adjusted to the matrix's shape: the step is "
                       "lr * adjust_lr's factor (self._apply does it)",
}


def _first_difference(got, want):
    """(step, matrix) of the first parameter that is not bit for bit the same, or None."""
    for t, (gs, ws) in enumerate(zip(got, want)):
        for i, (g, w) in enumerate(zip(gs, ws)):
            if not (isinstance(g, torch.Tensor) and g.shape == w.shape and torch.equal(g, w)):
                return t, i
    return None


def _trajectory_problem(where: str, got, want, kw: dict, missing: frozenset, owner=None,
                        rank=None) -> str | None:
    """None when `got` (parameters after each step) is `want` to the bit, else what is
    wrong, with the likeliest reason."""
    if len(got) != len(want):
        return f"{where}: {len(got)} steps recorded, want {len(want)}"
    first = _first_difference(got, want)
    if first is None:
        return None
    t, i = first
    g, w = got[t][i], want[t][i]
    at = f"{where}, step {t}, matrix {i} {tuple(w.shape)}"
    if g.shape != w.shape:
        return f"{at}: the parameter's shape became {tuple(g.shape)}"
    before = got[t - 1][i] if t else _params()[i].detach()
    if (t, i) in missing:
        return (f"{at} has no gradient at this step, and it changed: leave it (and its "
                "momentum) alone, as torch.optim.Muon does")
    if rank is not None and owner is not None and owner != rank:
        if torch.equal(g, before) or torch.equal(g, before * (1 - kw["lr"] * kw["weight_decay"])):
            return (f"{at}: its owner is rank {owner}, and on this rank it did not move (or "
                    "only decayed) while one process's did: every rank applies every matrix's "
                    "update, which reaches it from the owner by all_gather")
    for mistake, why in MISTAKES.items():
        if _first_difference(got, _written_out(kw, missing, mistake)) is None:
            return f"{at} differs from torch.optim.Muon's: {why}"
    err = (g - w).abs().max().item()
    size = max(w.abs().max().item(), 1e-30)
    if math.isfinite(err) and err <= 1e-2 * size:
        return (f"{at} differs from torch.optim.Muon's by at most {err:.3g}, within a few "
                "bf16 roundings but not to the bit: orthogonalise with ns_reference "
                "(minidist's newton_schulz) in self.ns_dtype, then self._apply(p, update, group), "
                "the arithmetic torch.optim.Muon uses")
    k = int((g - w).abs().reshape(-1).argmax())
    return (f"{at} differs from torch.optim.Muon's: element {k} is {g.reshape(-1)[k].item():.6g}, "
            f"want {w.reshape(-1)[k].item():.6g}")


# --------------------------------------------------------------------- the parts, run on every rank

def _part(missing: frozenset, fns: dict, r: int, n: int) -> dict:
    H.skip_dynamo_import()
    trajectory, opt, ps = _drive(lambda ps: fns["Muon"](ps, **DIST_KW), missing)
    momentum, state_bytes = {}, {}
    for i, p in enumerate(ps):
        state = opt.state.get(p, {})  # .get: reading must not create an entry
        state_bytes[i] = sum(v.numel() * v.element_size() for v in state.values()
                             if isinstance(v, torch.Tensor))
        if isinstance(state.get("momentum_buffer"), torch.Tensor):
            momentum[i] = state["momentum_buffer"].clone()
    return {"trajectory": trajectory, "momentum": momentum, "state_bytes": state_bytes}


PARTS = {"full": functools.partial(_part, frozenset()), "missing": functools.partial(_part, MISSING)}


def _preflight(cls) -> str | None:
    """The hint of a stub that raises NotImplementedError in one step in this process (no
    process group): then the launch, seconds of starting processes, would only bring back
    that same hint."""
    try:
        p = torch.nn.Parameter(_randn(6, 4))
        p.grad = _randn(6, 4, seed=1)
        cls([p], **DIST_KW).step()
    except NotImplementedError as e:
        return str(e)
    except Exception:  # anything else is for the ranks to show
        pass
    return None


_CACHE = H.Cache()


def _results(impl) -> dict:
    def compute():
        hint = _preflight(impl.Muon)
        if hint is not None:
            return {(p, n): ("notimpl", hint) for p in PARTS for n in WORLD_SIZES}
        return H.run_all(PARTS, {"Muon": impl.Muon}, WORLD_SIZES, TIMEOUT_S, HANG_HINT, RULES)
    return _CACHE.get((impl.Muon, WORLD_SIZES, TIMEOUT_S), compute)  # tests change the last two


def _owners(per_rank) -> dict:
    """{matrix: the ranks that keep its momentum}."""
    return {i: [r for r, res in enumerate(per_rank) if i in res["momentum"]] for i in range(len(SHAPES))}


# --------------------------------------------------------------------- the checks: newton_schulz

@check("07", points=3, name="newton_schulz, fp32: each singular value s -> p^k(s / ||G||_F), U and V kept")
def _singular_values(impl):
    for (m, n), steps in [((48, 96), 5), ((64, 64), 5), ((40, 72), 2)]:
        # from 3e-3 to 3: the iteration works only after the division by the norm
        s = 3 * np.geomspace(1e-3, 1.0, min(m, n))
        G, U, V = _with_singular_values(s, m, n, seed=m + n)
        G32 = G.float()
        O = impl.newton_schulz(G32, steps, dtype=torch.float32)
        what = f"newton_schulz(G of shape {(m, n)}, steps={steps}, dtype=torch.float32)"
        H.first_problem([_shape_problem(what, O, (m, n))])
        assert O.dtype == torch.float32, f"{what} returned {O.dtype}, want torch.float32"
        core = U.T @ O.double() @ V  # diagonal, holding p^k of each singular value, if U, V kept
        got = torch.diagonal(core).numpy()
        want = _poly(s / np.linalg.norm(s), steps)
        if np.allclose(got, want, atol=2e-5, rtol=1e-4):
            off = (core - torch.diag(torch.diagonal(core))).abs().max().item()
            assert off < 2e-5, (
                f"{what}: the singular vectors changed (U^T O V is off-diagonal by up to "
                f"{off:.3g}): X <- a X + (b A + c A^2) X with A = X X^T keeps them; check the "
                "order of the products")
            rest = (O.double() - U @ core @ V.T).abs().max().item()
            assert rest < 1e-4, (f"{what}: the result has a part outside G's row and column "
                                 f"spaces ({rest:.3g})")
            continue
        finite = bool(np.isfinite(got).all())
        big = f"singular values up to {np.abs(got).max():.3g}" if finite else "inf or NaN"
        assert finite and np.abs(got).max() < 2, (
            f"{what}: for singular values of G between {s.min():.3g} and {s.max():.3g} the result "
            f"holds {big}: divide X by its Frobenius norm (clamped below by eps) before the "
            "iteration, so that every singular value starts "
            "in [0, 1]")
        for k in range(0, 9):
            if k != steps and np.allclose(got, _poly(s / np.linalg.norm(s), k), atol=2e-5, rtol=1e-4):
                raise AssertionError(f"{what}: the singular values are those of {k} steps, want {steps}")
        if np.allclose(got, _poly(s / s.max(), steps), atol=2e-5, rtol=1e-4):
            raise AssertionError(f"{what}: you divided by the largest singular value; divide by the "
                                 "Frobenius norm, X.norm(dim=(-2, -1), keepdim=True)")
        i = int(np.abs(got - want).argmax())
        raise AssertionError(
            f"{what}: G's singular value {s[i]:.4g} became {got[i]:.6g}, want p^{steps}({s[i]:.4g} "
            f"/ ||G||_F) = {want[i]:.6g}, p(x) = a x + b x^3 + c x^5, (a, b, c) = {COEFFICIENTS}")


@check("07", points=1, name="newton_schulz, tall: transpose of the wide case, iterated on the wide side")
def _tall(impl):
    for m, n in [(96, 48), (80, 16)]:
        G = _randn(m, n, seed=m)
        wide = G.T.contiguous()
        O = impl.newton_schulz(G, dtype=torch.float32)
        what = f"newton_schulz(G of shape {(m, n)}, dtype=torch.float32)"
        H.first_problem([_shape_problem(what, O, (m, n)), _finite_problem(what, O, G)])
        W = impl.newton_schulz(wide, dtype=torch.float32)
        err = (O.float() - W.float().T).abs().max().item()
        assert err <= 1e-4, (
            f"{what} is not the transpose of newton_schulz(G.T) (they differ by up to {err:.3g}): "
            "transpose a tall matrix, iterate, transpose back")
        tall_flops = _flops(lambda: impl.newton_schulz(G, dtype=torch.float32))
        wide_flops = _flops(lambda: impl.newton_schulz(wide, dtype=torch.float32))
        assert tall_flops > 0, f"{what}: counted no matrix products (torch.utils.flop_counter); use torch's"
        assert tall_flops <= 1.01 * wide_flops, (
            f"{what} took {tall_flops:,} FLOPs, its {n}x{m} transpose {wide_flops:,}: iterate on "
            f"the wide side (transpose a tall matrix first), where the Gram matrix X X^T is "
            f"{n}x{n}, not {m}x{m}")


@check("07", points=1, name="newton_schulz, batched: each matrix of the leading dimensions on its own")
def _batched(impl):
    for shape in [(2, 3, 16, 24), (4, 24, 16)]:
        G = _randn(*shape, seed=len(shape))
        # norms from 0.01 to 100: a norm taken over the whole batch would shrink the small ones
        scales = torch.logspace(-2, 2, math.prod(shape[:-2])).reshape(*shape[:-2], 1, 1)
        G = G * scales
        O = impl.newton_schulz(G, dtype=torch.float32)
        what = f"newton_schulz(a batch of shape {shape}, dtype=torch.float32)"
        H.first_problem([_shape_problem(what, O, shape)])
        flat, Gs = O.reshape(-1, *shape[-2:]), G.reshape(-1, *shape[-2:])
        for k in range(Gs.shape[0]):
            alone = impl.newton_schulz(Gs[k], dtype=torch.float32)
            H.first_problem([_finite_problem(f"newton_schulz(matrix {k} of the batch alone)", alone, Gs[k]),
                             _finite_problem(f"{what}, matrix {k}", flat[k], Gs[k])])
            err = (flat[k].float() - alone.float()).abs().max().item()
            assert err <= 1e-5, (
                f"{what}: matrix {k} of the batch (norm {Gs[k].norm():.3g}) differs from "
                f"newton_schulz of it alone by up to {err:.3g}: each matrix is its own problem, "
                "normalised by its own Frobenius norm (X.norm(dim=(-2, -1), keepdim=True)), "
                "not the whole batch's")


@check("07", points=1, name="newton_schulz, dtype: runs in and returns dtype (bf16 default), G left alone")
def _dtype(impl):
    G = _randn(48, 96, seed=3)
    for args, kw, want in [((G,), {}, torch.bfloat16), ((G,), dict(dtype=torch.float32), torch.float32),
                           ((G.double(),), dict(dtype=torch.float32), torch.float32),
                           ((G.bfloat16(), 3), {}, torch.bfloat16)]:
        O = impl.newton_schulz(*args, **kw)
        extra = "".join(f", {k}={v}" for k, v in kw.items()) + (", steps=3" if len(args) > 1 else "")
        what = f"newton_schulz(a {args[0].dtype} matrix{extra})"
        H.first_problem([_shape_problem(what, O, G.shape), _finite_problem(what, O, G)])
        assert O.dtype == want, f"{what} returned {O.dtype}, want {want}"
    O16, O32 = impl.newton_schulz(G), impl.newton_schulz(G, dtype=torch.float32)
    rel = ((O16.float() - O32.float()).norm() / O32.float().norm()).item()
    assert rel < 0.03, (f"newton_schulz(G) in bf16 is {rel:.3g} away (relative) from the fp32 "
                        "result; a few bf16 roundings are about 0.01")
    assert not torch.equal(O16, O32.bfloat16()), (
        "newton_schulz(G) in bf16 equals the fp32 result rounded to bf16: it was computed in "
        "fp32 and converted at the end; convert G to dtype first and iterate in dtype")
    for X, kw in [(G.bfloat16(), {}), (G.clone(), dict(dtype=torch.float32))]:
        before = X.clone()
        impl.newton_schulz(X, **kw)
        assert torch.equal(X, before), (
            f"newton_schulz changed its {X.dtype} input{' (dtype=torch.float32)' if kw else ''}: "
            "G.to(dtype) is G itself when G already has that dtype, so an in-place division "
            "changes the caller's tensor (in Muon: the momentum buffer). Divide out of place")


@check("07", points=1, name="newton_schulz of a zero matrix is zeros, not NaN (eps)")
def _zeros(impl):
    for shape, kw in [((8, 4), {}), ((4, 8), dict(dtype=torch.float32)), ((2, 5, 5), {})]:
        O = impl.newton_schulz(torch.zeros(*shape), **kw)
        what = f"newton_schulz(torch.zeros{shape}{', dtype=torch.float32' if kw else ''})"
        H.first_problem([_shape_problem(what, O, shape)])
        assert torch.isfinite(O).all() and not O.any(), (
            f"{what} holds {'non-finite values' if not torch.isfinite(O).all() else 'non-zeros'}: "
            "divide by the norm clamped below by eps, X.norm(...).clamp(min=eps)")
    G = torch.stack([torch.zeros(6, 10), _randn(6, 10, seed=5)])
    O = impl.newton_schulz(G, dtype=torch.float32)
    assert torch.isfinite(O[0]).all() and not O[0].any(), (
        "newton_schulz(a batch of a zero matrix and a random one): the zero matrix did not give "
        "zeros; normalise each matrix by its own norm, clamped below by eps")


@check("07", points=1, name="newton_schulz, bf16: bit for bit torch's own (torch.optim._muon)")
def _bitwise(impl):
    cases = [(_randn(48, 96, seed=6), 5), (_randn(96, 48, seed=7), 5), (_randn(64, 64, seed=8), 5),
             (_randn(7, 130, seed=9), 3), (_randn(3, 32, 48, seed=10), 5)]
    for G, steps in cases:
        O = impl.newton_schulz(G, steps)
        what = f"newton_schulz(G of shape {tuple(G.shape)}, steps={steps})"
        H.first_problem([_shape_problem(what, O, G.shape), _finite_problem(what, O, G)])
        want = torch.stack([_torch_ns(g, COEFFICIENTS, steps, 1e-7) for g in G.reshape(-1, *G.shape[-2:])])
        want = want.reshape(G.shape)
        if O.dtype == torch.bfloat16 and torch.equal(O, want):
            continue
        rel = ((O.float() - want.float()).norm() / want.float().norm()).item()
        if rel < 0.05:
            raise AssertionError(
                f"{what} is within bf16 rounding of torch's (relative difference {rel:.3g}) but "
                "not equal to the bit: compute as torch does: convert to dtype first, then divide "
                "by the norm (computed in dtype, clamped by eps); B = torch.baddbmm(A, A, A, "
                "beta=b, alpha=c), X = torch.baddbmm(X, B, X, beta=a) (not b * A + c * A @ A)")
        raise AssertionError(f"{what} differs from torch's Newton-Schulz: relative difference {rel:.3g}")


# --------------------------------------------------------------------- the checks: Muon

@check("07", points=3, name="Muon, one process: == torch.optim.Muon to the bit (nesterov, decay, lr rule)")
def _one_process(impl):
    missing = frozenset({(1, 2), (2, 5)})
    for kw in SINGLE_KW:
        got, _, _ = _drive(lambda ps: impl.Muon(ps, **kw), missing)
        want, _ = _torch_muon(tuple(sorted(kw.items())), missing)
        H.first_problem([_trajectory_problem(f"Muon(**{kw})", got, want, kw, missing)])


def _ranks(impl, part):
    return H.per_world_size(_results(impl), part, WORLD_SIZES)


def _dist_problem(impl, part: str, missing: frozenset) -> str | None:
    """What is wrong with the first rank whose parameters differ from one process's."""
    want, _ = _torch_muon(tuple(sorted(DIST_KW.items())), missing)
    for n, per_rank in _ranks(impl, part):
        owners = _owners(per_rank)
        for r, res in enumerate(per_rank):
            first = _first_difference(res["trajectory"], want)
            if first is None:
                continue
            holders = owners[first[1]]
            return _trajectory_problem(f"on {n} ranks, rank {r}", res["trajectory"], want, DIST_KW,
                                       missing, holders[0] if len(holders) == 1 else None, r)
    return None


@check("07", points=3, name="2 and 3 ranks: every rank's parameters == one process's after every step")
def _distributed(impl):
    H.first_problem([_dist_problem(impl, "full", frozenset())])


@check("07", points=2, name="2 and 3 ranks: each matrix's momentum only on its owner, about 1/N per rank")
def _sharded_state(impl):
    _, want = _torch_muon(tuple(sorted(DIST_KW.items())), frozenset())
    total = sum(a * b * 4 for a, b in SHAPES)
    biggest = max(a * b * 4 for a, b in SHAPES)
    for n, per_rank in _ranks(impl, "full"):
        for i, ranks in _owners(per_rank).items():
            assert ranks, (f"on {n} ranks no rank keeps matrix {i}'s momentum in "
                           "self.state[p]['momentum_buffer'] (where the grader looks)")
            assert len(ranks) == 1, (
                f"on {n} ranks matrix {i}'s momentum is kept on ranks {ranks}: only its owner "
                "keeps it (and runs its Newton-Schulz), so each rank holds about 1/N of the "
                "optimizer state")
            got = per_rank[ranks[0]]["momentum"][i]
            assert got.shape == want[i].shape and torch.equal(got, want[i]), (
                f"on {n} ranks, matrix {i}'s momentum on its owner, rank {ranks[0]}, differs from "
                "torch.optim.Muon's: buf.lerp_(p.grad, 1 - momentum) at every step with a gradient")
        for r, res in enumerate(per_rank):
            mine = sum(res["state_bytes"].values())
            assert mine <= total / n + biggest, (
                f"on {n} ranks, rank {r} keeps {mine} bytes of optimizer state, of {total} in all: "
                f"more than total / {n} + the largest matrix ({biggest}); deal the matrices out "
                "evenly (sorted by size, in rounds of N)")


@check("07", points=2,
       name="2 and 3 ranks, some gradients None: all ranks join every collective, right result")
def _missing_grads(impl):
    try:
        problem = _dist_problem(impl, "missing", MISSING)
    except AssertionError as e:  # a hang or a mismatch: say which steps, and the rule
        why = str(e)
        raise AssertionError(f"{why} (in the run where these have no gradient: {_missing_text()})"
                             + ("" if HANG_HINT in why else f". {HANG_HINT}")) from None
    H.first_problem([problem])


def _missing_text() -> str:
    """MISSING in words: 'matrix 2 at step 1, matrices 2 and 5 at step 2'."""
    by_step = {}
    for t, i in sorted(MISSING):
        by_step.setdefault(t, []).append(str(i))
    return ", ".join((f"matrices {', '.join(i[:-1])} and {i[-1]}" if len(i) > 1 else f"matrix {i[0]}")
                     + f" at step {t}" for t, i in by_step.items())


# Tiered hints, shown one at a time by `python -m exercises.grade 07 --hint` (moved out of the stub, which poses the problem).
_NS_ITERATION = (
    "The iteration, on X = G converted to `dtype`: X = X / max(||X||_F, eps) (every "
    "singular value now in [0, 1]); repeat `steps` times: A = X X^T, B = b A + c A^2, "
    "X = a X + B X; return X (in `dtype`). Never divide G itself in place: work on the "
    "converted copy.")
_NS_TALL_BATCH = (
    "If X has more rows than columns, iterate on X^T (then X X^T is the smaller matrix) and"
    " transpose back at the end. For a batch, normalise each matrix by its own norm: "
    "X.norm(dim=(-2, -1), keepdim=True).")
_NS_BITS = (
    "To match torch's bits, compute as it does: convert to `dtype` first, then normalise "
    "(the norm computed in `dtype`); on X of shape (batch, m, n), A = torch.bmm(X, X.mT), "
    "B = torch.baddbmm(A, A, A, beta=b, alpha=c) and X = torch.baddbmm(X, B, X, beta=a) "
    "(torch.mm and torch.addmm for a single matrix are the same arithmetic). "
    "`b * A + c * A @ A` is the same mathematics, rounded differently. (On a CPU, prefer "
    "torch.bmm to `@` on 3-D bf16 tensors: the same bits, and here a hundred times "
    "faster.)")
_NS_RECIPE = (
    'newton_schulz: X = G.to(dtype); tall = X.size(-2) > X.size(-1); if tall: X = '
    'X.mT; reshape to (batch, m, n) with X.reshape(-1, *X.shape[-2:]); X = X / '
    'X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps); then `steps` times: A = '
    'torch.bmm(X, X.mT), B = torch.baddbmm(A, A, A, beta=b, alpha=c), X = '
    'torch.baddbmm(X, B, X, beta=a); reshape back to the batch shape and return '
    'X.mT if tall else X')
_MUON_ONE = (
    "One process, as torch.optim.Muon does, for each parameter with a gradient, in order: "
    "buf = self.state[p]['momentum_buffer'] (zeros like p at first); buf.lerp_(p.grad, 1 - "
    "momentum) (buf = momentum buf + (1 - momentum) grad); M = p.grad.lerp(buf, momentum) "
    "if nesterov else buf; O = ns_reference(M, ns_steps, self.ns_dtype); self._apply(p, O, "
    "group) (weight decay, then the adjusted step).")
_MUON_OWNERS = (
    "Deal the matrices out so each rank holds about 1/N of the momentum. A balanced way: "
    "sort the matrices by cost, largest first, and deal them out in rounds of N, the r-th "
    "matrix of each round to rank r. Every rank computes the same dealing.")
_MUON_GATHER = (
    "The updates travel by dist.all_gather, for instance one per round, one slot per rank, "
    "each slot [flag, flattened update, zero padding] in ns_dtype, flag 0 meaning 'no "
    "update'; every rank applies every update with self._apply. Every rank joins every "
    "round's all_gather, also the owner of a matrix without a gradient, and a rank that "
    "owns nothing in a round.")

# hints that several checks share
_HINT_STEP = (
    'step: rank, world = self._world(); items = [(p, g) for g in self.param_groups '
    "for p in g['params']]. One rank: self._apply(p, self._update(p, g), g) for "
    'each p with a grad. N ranks: sort the items by cost, largest first, in rounds '
    'of N; per round send = zeros(1 + largest numel, ns_dtype); rank r, owner of '
    "the round's r-th item, writes [1, update.flatten()] if it has a grad; every "
    'rank, every round: dist.all_gather(recv, send, group=self.group, '
    'async_op=True); then wait, and self._apply(p, recv[r][1:1 + p.numel()], g) '
    'where recv[r][0] == 1')

HINTS = {
    "_singular_values": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_tall": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_batched": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_dtype": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_zeros": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_bitwise": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_one_process": [
        _MUON_ONE,
        "_update: buf = self.state[p].setdefault('momentum_buffer', "
        "torch.zeros_like(p)); buf.lerp_(p.grad, 1 - g['momentum']); M = "
        "p.grad.lerp(buf, g['momentum']) if g['nesterov'] else buf; return "
        "ns_reference(M, g['ns_steps'], self.ns_dtype)",
        _HINT_STEP,
    ],
    "_distributed": [
        _MUON_OWNERS, _MUON_GATHER,
        _HINT_STEP,
    ],
    "_sharded_state": [
        _MUON_OWNERS,
        _HINT_STEP,
    ],
    "_missing_grads": [
        _MUON_GATHER,
        _HINT_STEP,
    ],
}
