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

Muon on shards (part (c)) runs in its own launch per world size, under its own rules (no
all-gather of any kind, SHARD_RULES): the shards of every rank are put back together and
compared with torch.optim.Muon on the whole matrices (within SHARD_TOL of the movement),
the momenta each rank keeps with its ownership, and the bytes each rank received (every
collective and message recorded below torch.distributed's Python, exercises/_traffic.py)
with what the layout says it must receive; each rank's gradient pieces, and each piece of
update it applied, must have travelled in the recorded messages and collectives. Its reference, reference_muon_step_on_shards, lives here: minidist's
Muon under ZeRO works on its own objects, not on bare shards.
"""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as _torch_ns_itself
from torch.utils.flop_counter import FlopCounterMode

from exercises import _harness as H
from exercises import _measure, _rules, _traffic
from exercises.grade import check

# The exercise's rules, watched in every check and part while the learner's code runs
# (exercises/_rules.py): torch's Muon and its Newton-Schulz are the grader's oracles.
_ORACLE = "exercise 07 writes Newton-Schulz and Muon: torch's are the grader's oracles"
# minidist's modules for this exercise's idea: the learner's file may not name them
# (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.muon", "minidist.muon.orthogonalize", "minidist.zero")
IDEA_ALLOWED = ("minidist.muon.adjust_lr", "minidist.muon.newton_schulz")  # what the stub itself hands out
RULES = _rules.Rules(apis={"torch.optim.Muon": _ORACLE,
                           "torch.optim._muon._zeropower_via_newtonschulz": _ORACLE})


_PART_A = ("part (a) is yours to write: ns_reference (minidist's newton_schulz), handed out "
           "for parts (b) and (c), is not an answer to part (a)")
PART_A_RULES = _rules.Rules(apis={"minidist.muon.orthogonalize.newton_schulz": _PART_A,
                                  "minidist.muon.orthogonalize.newton_schulz_many": _PART_A})


@contextlib.contextmanager
def _own_newton_schulz(impl):
    """Part (a)'s checks run the learner's newton_schulz in here: minidist's trips (any
    alias of it: exercises/_rules.py swaps the function's code), and a check whose code
    called it fails, saying so. minidist's own, graded with --reference, is exempt."""
    import minidist.muon.orthogonalize as ns
    theirs = "newton_schulz" in getattr(impl, "learner_names", ()) or impl.newton_schulz is not ns.newton_schulz
    if not theirs:
        yield
        return
    with _rules.refusing(PART_A_RULES, " (this check scores 0)"):
        yield


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


def _drive(make, missing=frozenset(), flops=None):
    """STEPS steps of the optimizer make(params) on seeded gradients, the (step, matrix)
    pairs of `missing` without one; (parameters after each step, optimizer, parameters).
    On the ranks each step's traffic is labelled with its number, and `flops` (a list)
    receives each step's FLOPs of matrix products, on any thread (exercises/_traffic.py)."""
    ps = _params()
    opt = make(ps)
    trajectory = []
    traffic = _traffic.current()
    for t in range(STEPS):
        for i, (p, grad) in enumerate(zip(ps, _grads(t))):
            p.grad = None if (t, i) in missing else grad
        with traffic.phase_of(t) if traffic is not None else contextlib.nullcontext(), \
                _traffic.counting_matmuls() if flops is not None else contextlib.nullcontext([]) as mm:
            opt.step()
        if flops is not None:
            flops.append(sum(f for _, _, f in mm))
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
    flops = []
    trajectory, opt, ps = _drive(lambda ps: fns["Muon"](ps, **DIST_KW), missing, flops)
    momentum, state_bytes = {}, {}
    for i, p in enumerate(ps):
        state = opt.state.get(p, {})  # .get: reading must not create an entry
        state_bytes[i] = sum(v.numel() * v.element_size() for v in state.values()
                             if isinstance(v, torch.Tensor))
        if isinstance(state.get("momentum_buffer"), torch.Tensor):
            momentum[i] = state["momentum_buffer"].clone()
    # state kept anywhere the optimizer can reach (its attributes, the parameters and their
    # hooks, the learner's module), parameters and gradients left out (exercises/_measure.py)
    found = _measure.reachable([opt, *ps], modules={type(opt).__module__})
    leave_out = _measure.storages(ps) | _measure.storages(p.grad for p in ps)
    held = _measure.total(found, leave_out)
    # what each step's collectives carried (this rank's part), for the grading side
    sent = {t: [d.reshape(-1) for e in H.traffic().events if e.phase == t and e.kind != "barrier"
                for d in e.data or []] for t in range(STEPS)}
    return {"trajectory": trajectory, "momentum": momentum, "state_bytes": state_bytes,
            "held": held, "flops": flops, "sent": sent}


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
        hint = H.preflight(_preflight, impl.Muon)
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
    with _own_newton_schulz(impl):
        _singular_values_body(impl)


def _singular_values_body(impl):
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
    with _own_newton_schulz(impl):
        _tall_body(impl)


def _tall_body(impl):
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
    with _own_newton_schulz(impl):
        _batched_body(impl)


def _batched_body(impl):
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
    with _own_newton_schulz(impl):
        _dtype_body(impl)


def _dtype_body(impl):
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
    with _own_newton_schulz(impl):
        _zeros_body(impl)


def _zeros_body(impl):
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
    with _own_newton_schulz(impl):
        _bitwise_body(impl)


def _bitwise_body(impl):
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
    H.first_problem(_carried_problem(n, per_rank, frozenset()) for n, per_rank in _ranks(impl, "full"))


@functools.lru_cache(maxsize=None)
def _ns_flops(shape: tuple, steps: int = 5) -> int:
    """FLOPs of matrix products in one Newton-Schulz of a matrix of `shape`, counted on
    torch's own (the oracle), at the dispatcher as the ranks count the learner's."""
    with _traffic.counting_matmuls() as mm:
        _torch_ns(torch.zeros(shape) + 1.0, COEFFICIENTS, steps, 1e-7)
    return sum(f for _, _, f in mm)


def _work_problem(n: int, per_rank: list, missing: frozenset) -> str | None:
    """None when each rank's matrix products in each step are exactly the Newton-Schulz of
    the matrices it owns (keeps the momentum of) that have a gradient at that step."""
    owners = _owners(per_rank)
    for r, res in enumerate(per_rank):
        mine = [i for i, holders in owners.items() if holders == [r]]
        for t, got in enumerate(res["flops"]):
            todo = [i for i in mine if (t, i) not in missing]
            want = sum(_ns_flops(SHAPES[i]) for i in todo)
            if got == want:
                continue
            every = sum(_ns_flops(SHAPES[i]) for i in range(len(SHAPES)) if (t, i) not in missing)
            why = (" (the Newton-Schulz of every matrix: each rank orthogonalised them all, while "
                   "only the owners keep the momentum)" if got >= every else
                   ": more than its own matrices need: it orthogonalised matrices it does not own"
                   if got > want else ": less than its own matrices need")
            return (f"on {n} ranks, rank {r}, step {t}: its matrix products took {got:,} FLOPs "
                    f"(counted below Python, on every thread); the Newton-Schulz of the matrices "
                    f"it owns (those whose momentum it keeps: {todo}) takes {want:,}{why}. Each "
                    "matrix's owner alone runs its Newton-Schulz (1/N of the work per rank)")
    return None


@functools.lru_cache(maxsize=None)
def _oracle_updates(missing: frozenset) -> dict:
    """{(step, matrix): torch.optim.Muon's orthogonalised update (bf16), flattened}."""
    kw = DIST_KW
    lr, mu, wd = kw["lr"], kw["momentum"], kw["weight_decay"]
    ps, bufs, out = [p.detach() for p in _params()], {}, {}
    with torch.no_grad():
        for t in range(STEPS):
            for i, (p, grad) in enumerate(zip(ps, _grads(t))):
                if (t, i) in missing:
                    continue
                buf = bufs.setdefault(i, torch.zeros_like(p))
                buf.lerp_(grad, 1 - mu)
                update = _torch_ns(grad.lerp(buf, mu), COEFFICIENTS, 5, 1e-7)
                out[t, i] = update.reshape(-1).float()
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-(lr * _lr_factor(p.shape, None)))
    return out


def _contains(hay: torch.Tensor, needle: torch.Tensor) -> bool:
    """Does `hay` hold `needle` as a contiguous run, bit for bit (as floats)?"""
    L = needle.numel()
    if L == 0:
        return True
    for k in (hay[:max(0, hay.numel() - L + 1)] == needle[0]).nonzero().reshape(-1).tolist():
        if torch.equal(hay[k:k + L], needle):
            return True
    return False


def _carried_problem(n: int, per_rank: list, missing: frozenset) -> str | None:
    """None when every update of every step travelled in that step's recorded collectives
    (some rank put it in, bit for bit: exercises/_traffic.py records what each sends)."""
    for (t, i), update in _oracle_updates(missing).items():
        hay = [torch.cat([d.float() for d in res["sent"][t]]) if res["sent"][t] else torch.zeros(0)
               for res in per_rank]
        if not any(_contains(h, update) for h in hay):
            return (f"on {n} ranks, step {t}: matrix {i}'s orthogonalised update is in none of the "
                    "collectives the ranks issued in that step (the grader records what each "
                    "rank puts into them, below torch.distributed's Python): the owner's update "
                    "reaches the other ranks by all_gather, not another way")
    return None


@check("07", points=2, name="2 and 3 ranks: each matrix's momentum and Newton-Schulz only on its owner, "
                            "about 1/N per rank")
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
            assert res["held"] <= total / n + biggest, (
                f"on {n} ranks, rank {r}: tensors its optimizer can reach hold {res['held']} bytes "
                "besides the parameters and their gradients (the grader walks every reference "
                "from it, the parameters and their hooks, and your module's globals), of "
                f"{total} bytes of momentum in all: more than total / {n} + the largest matrix "
                f"({biggest}). Momentum kept anywhere counts, not only in self.state")
        H.first_problem([_work_problem(n, per_rank, frozenset())])


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
    for n, per_rank in _ranks(impl, "missing"):
        H.first_problem([_carried_problem(n, per_rank, MISSING), _work_problem(n, per_rank, MISSING)])


def _missing_text() -> str:
    """MISSING in words: 'matrix 2 at step 1, matrices 2 and 5 at step 2'."""
    by_step = {}
    for t, i in sorted(MISSING):
        by_step.setdefault(t, []).append(str(i))
    return ", ".join((f"matrices {', '.join(i[:-1])} and {i[-1]}" if len(i) > 1 else f"matrix {i[0]}")
                     + f" at step {t}" for t, i in by_step.items())


# --------------------------------------------------------------------- part (c): Muon on shards

# 5 matrices of uneven shapes, 4799 elements: neither 2 nor 3 divides their number, the
# layout is padded at both world sizes, and on 2 ranks matrix 2, on 3 ranks matrices 1 and 3,
# straddle two ranks' shards
SHARD_SHAPES = ((24, 40), (40, 24), (33, 31), (16, 56), (48, 20))
SHARD_STEPS = 3
SHARD_KW = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
SHARD_TOL = 0.01  # of how far a matrix has moved: bf16 rounds by up to 2^-8 = 0.4%
SHARD_FLAG_BYTES = 64  # per matrix, the bound's allowance for flags
_ALL_GATHERS = ("allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
                "_allgather_base", "all_gather_single", "all_gather_single_coalesced")
SHARD_RULES = _rules.Rules(
    allowed=tuple(c for c in _rules.COLLECTIVES if c not in _ALL_GATHERS),
    collective_rule="Muon on shards sends each owner only its matrices' gradient pieces and "
                    "each rank only its shard's update pieces (dist.all_to_all_single with "
                    "split sizes, or dist.isend/irecv); an all-gather (any form) would hand "
                    "every rank every shard, which is what ZeRO avoids",
    apis=RULES.apis)
SHARD_HANG_HINT = ("Every rank must join every collective of the step, in the same order and "
                   "with matching sizes: also a rank that owns no matrix, or holds no piece of "
                   "one (a split size of 0).")


def _shard_owners(n: int) -> list[int]:
    """Matrix i's owner: never the rank that holds it all (on 2 ranks matrix 1 is an
    exception: it lies in its owner's shard, and nothing of it needs to move)."""
    return [(i + 1) % n for i in range(len(SHARD_SHAPES))]


def _starts(shapes=SHARD_SHAPES) -> list[int]:
    return [sum(a * b for a, b in shapes[:i]) for i in range(len(shapes) + 1)]


def _shard_len(n: int) -> int:
    return math.ceil(_starts()[-1] / n)


def _flat(mats, n: int) -> torch.Tensor:
    """The matrices flattened, concatenated and padded with zeros to n x S."""
    flat = torch.cat([m.detach().reshape(-1) for m in mats])
    return torch.cat([flat, flat.new_zeros(n * _shard_len(n) - flat.numel())])


def _overlap(i: int, j: int, n: int) -> int:
    """Elements of matrix i in rank j's shard."""
    S, st = _shard_len(n), _starts()
    return max(0, min(st[i + 1], (j + 1) * S) - max(st[i], j * S))


def _must_receive(n: int) -> list[tuple[int, int]]:
    """Per rank, the elements it must receive: (of the matrices it owns, those outside its
    shard: gradients; of its shard, those of matrices another rank owns: updates)."""
    owners, k = _shard_owners(n), len(SHARD_SHAPES)
    return [(sum(_overlap(i, j, n) for i in range(k) for j in range(n) if j != r and owners[i] == r),
             sum(_overlap(i, r, n) for i in range(k) if owners[i] != r))
            for r in range(n)]


def _shard_bound(n: int) -> list[int]:
    """Bytes per rank per step: gradients in fp32 (the shards' dtype), updates in bf16 (the
    Newton-Schulz dtype, as Muon's all_gather sends them), and flags."""
    return [4 * g + 2 * u + SHARD_FLAG_BYTES * len(SHARD_SHAPES) for g, u in _must_receive(n)]


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _received(e, rank: int, n: int) -> int:
    """Bytes that reach this rank from the others in one recorded call (an Event of
    exercises/_traffic.py: every collective and message, seen below torch's Python)."""
    a, root = e.args, e.peer
    if e.op == "alltoall_base":
        out, splits = a[0], list(a[2]) if len(a) > 2 else []
        rows = out.shape[0] if out.dim() else 1
        own = splits[rank] if splits else rows // n
        return (rows - own) * _nbytes(out) // max(rows, 1)
    if e.op == "alltoall":
        return sum(_nbytes(t) for j, t in enumerate(a[0]) if j != rank)
    if e.kind == "gather":
        return sum(_nbytes(t) for j, t in enumerate(a[0][0]) if j != root) if a[0] and rank == root else 0
    if e.kind in ("scatter", "broadcast"):
        return e.received if rank != root else 0
    if e.kind == "all_reduce":  # what a ring all-reduce receives
        return 2 * (n - 1) * e.received // n
    if e.kind == "recv":
        return e.received
    if e.kind in ("send", "barrier"):
        return 0
    return e.sent + e.received  # anything else: every tensor it touches, an upper bound


def _pieces_not_sent(sent: list, grad_shard: torch.Tensor, owners: list, r: int, n: int, t: int) -> str | None:
    """None when this rank's recorded sends of step t hold, bit for bit, every piece of
    its gradient shard that belongs to a matrix another rank owns."""
    hay = torch.cat([d.float().reshape(-1) for d in sent]) if sent else torch.zeros(0)
    S, st = grad_shard.numel(), _starts()
    for i, o in enumerate(owners):
        a, b = max(st[i], r * S), min(st[i + 1], (r + 1) * S)
        if o == r or a >= b:
            continue
        if not _contains(hay, grad_shard[a - r * S:b - r * S].float()):
            return (f"on {n} ranks (owners {owners}), step {t}: rank {r} holds elements [{a - st[i]}, "
                    f"{b - st[i]}) of matrix {i}'s gradient, whose owner is rank {o}, and none of "
                    "its recorded messages or collectives carried them (the grader records what "
                    "each rank sends, below torch.distributed's Python): the owner gets its "
                    "matrices' gradient pieces in them, not another way")
    return None


def _shards_part(fns: dict, r: int, n: int) -> dict:
    """On each rank: SHARD_STEPS steps of the learner's muon_step_on_shards on this rank's
    shards of seeded parameters and gradients."""
    S, owners = _shard_len(n), _shard_owners(n)
    param_shard = _flat(_params(SHARD_SHAPES), n)[r * S:(r + 1) * S].clone()
    momenta, trajectory, got, sent, carried = {}, [], {}, [], None
    traffic = H.traffic()
    for t in range(SHARD_STEPS):
        grad_shard = _flat(_grads(t, SHARD_SHAPES), n)[r * S:(r + 1) * S].clone()
        with traffic.phase_of(t):
            fns["muon_step_on_shards"](param_shard, grad_shard, list(SHARD_SHAPES), list(owners),
                                       momenta, **SHARD_KW)
        trajectory.append(param_shard.detach().clone())
        step = [d.reshape(-1) for e in traffic.events if e.phase == t and e.kind != "barrier"
                for d in e.data or []]
        sent.append(step)
        carried = carried or _pieces_not_sent(step, grad_shard, owners, r, n, t)
    for e in traffic.events:
        got[e.op] = got.get(e.op, 0) + _received(e, r, n)
    kept = {i: (v.detach().clone() if isinstance(v, torch.Tensor) else None) for i, v in momenta.items()}
    return {"trajectory": trajectory, "momenta": kept, "received": got, "sent": sent,
            "carried": carried}


@torch.no_grad()
def reference_muon_step_on_shards(param_shard, grad_shard, shapes, owners, momenta, lr=0.02,
                                  momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5,
                                  adjust_lr_fn=None, ns_dtype=torch.bfloat16, group=None):
    """Exercise 07 (c)'s reference: one all_to_all_single brings the gradient pieces to the
    owners, another takes the update pieces back (see the stub's docstring)."""
    import torch.distributed as dist

    from minidist.muon import adjust_lr
    from minidist.muon.orthogonalize import newton_schulz
    rank, n, S = dist.get_rank(group), dist.get_world_size(group), param_shard.numel()
    st = [0]
    for a, b in shapes:
        st.append(st[-1] + a * b)

    def piece(i, j):  # matrix i's elements in rank j's shard, in flat coordinates
        return max(st[i], j * S), min(st[i + 1], (j + 1) * S)

    def pieces(j, mine):  # [(i, a, b)] of the matrices `mine` that lie in rank j's shard
        return [(i, *piece(i, j)) for i in mine if piece(i, j)[0] < piece(i, j)[1]]

    of = [[i for i, o in enumerate(owners) if o == j] for j in range(n)]
    # (1) to each owner j, the pieces of its matrices in my shard; from each rank, mine
    send = [grad_shard[a - rank * S:b - rank * S] for j in range(n) for _, a, b in pieces(rank, of[j])]
    out_sizes = [sum(b - a for _, a, b in pieces(j, of[rank])) for j in range(n)]
    in_sizes = [sum(b - a for _, a, b in pieces(rank, of[j])) for j in range(n)]
    recv = grad_shard.new_empty(sum(out_sizes))
    dist.all_to_all_single(recv, torch.cat(send) if send else grad_shard[:0], out_sizes, in_sizes,
                           group=group)
    whole = {i: [] for i in of[rank]}
    at = 0
    for j in range(n):  # rank j's pieces come in matrix order; ranks in order rebuild each matrix
        for i, a, b in pieces(j, of[rank]):
            whole[i].append(recv[at:at + b - a])
            at += b - a
    # (2) the owner's work: momentum, Newton-Schulz
    updates = {}
    for i in of[rank]:
        g = torch.cat(whole[i]).view(shapes[i])
        buf = momenta.setdefault(i, torch.zeros_like(g))
        buf.lerp_(g, 1 - momentum)
        m = g.lerp(buf, momentum) if nesterov else buf
        updates[i] = newton_schulz(m, ns_steps, ns_dtype).reshape(-1)
    # (3) to each rank j, the pieces of my updates in its shard; (4) apply mine
    send = [updates[i][a - st[i]:b - st[i]] for j in range(n) for i, a, b in pieces(j, of[rank])]
    recv = torch.empty(sum(in_sizes), dtype=ns_dtype)
    dist.all_to_all_single(recv, torch.cat(send) if send else recv[:0], in_sizes, out_sizes,
                           group=group)
    at = 0
    for j in range(n):
        for i, a, b in pieces(rank, of[j]):
            p = param_shard[a - rank * S:b - rank * S]
            p.mul_(1 - lr * weight_decay)
            p.add_(recv[at:at + b - a], alpha=-adjust_lr(lr, shapes[i], adjust_lr_fn))
            at += b - a


def _shards_preflight(fn) -> str | None:
    """A stub's hint, without a launch (see _preflight)."""
    try:
        fn(torch.zeros(4), torch.zeros(4), [(2, 2)], [0], {}, **SHARD_KW)
    except NotImplementedError as e:
        return str(e)
    except Exception:  # no process group here: the ranks will show anything else
        pass
    return None


_SHARDS_CACHE = H.Cache()


def _shards_results(impl) -> dict:
    fn = impl.muon_step_on_shards

    def compute():
        hint = H.preflight(_shards_preflight, fn)
        if hint is not None:
            return {("shards", n): ("notimpl", hint) for n in WORLD_SIZES}
        return H.run_all({"shards": _shards_part}, {"muon_step_on_shards": fn}, WORLD_SIZES,
                         TIMEOUT_S, SHARD_HANG_HINT, SHARD_RULES)
    return _SHARDS_CACHE.get((fn, WORLD_SIZES, TIMEOUT_S), compute)


@functools.lru_cache(maxsize=None)
def _shards_oracle(mistake: str | None = None):
    """torch.optim.Muon on the whole matrices: (parameters after each step, final momentum
    per matrix). With a mistake, the same steps written out with it, to name it."""
    ps = _params(SHARD_SHAPES)
    trajectory = []
    with _rules.exempt(), torch.no_grad():  # the grader's oracles
        opt = torch.optim.Muon(ps, **SHARD_KW) if mistake is None else None
        bufs = [torch.zeros_like(p) for p in ps]
        for t in range(SHARD_STEPS):
            for i, (p, grad) in enumerate(zip(ps, _grads(t, SHARD_SHAPES))):
                p.grad = grad
                if opt is not None:
                    continue
                mu, lr, wd = SHARD_KW["momentum"], SHARD_KW["lr"], SHARD_KW["weight_decay"]
                bufs[i].lerp_(grad, 1 - mu)
                m = grad if mistake == "no momentum" else grad.lerp(bufs[i], mu)
                update = _torch_ns(m, COEFFICIENTS, 5, 1e-7)
                if mistake != "no weight decay":
                    p.mul_(1 - lr * wd)
                factor = 1.0 if mistake == "lr not adjusted" else _lr_factor(p.shape, None)
                p.add_(update, alpha=-lr * factor)
            if opt is not None:
                opt.step()
            trajectory.append([p.detach().clone() for p in ps])
    momentum = {i: opt.state[p]["momentum_buffer"].clone() for i, p in enumerate(ps)} if opt else {}
    return trajectory, momentum


SHARD_MISTAKES = {
    "no momentum": "it is the update of the raw gradient: Newton-Schulz orthogonalises the "
                   "(Nesterov) momentum, buf.lerp_(grad, 1 - momentum) kept in momenta[i] "
                   "across steps, then grad.lerp(buf, momentum)",
    "no weight decay": "weight decay was not applied: param.mul_(1 - lr * weight_decay) on the "
                       "piece before the step",
    "lr not adjusted": "the learning rate was not adjusted to the matrix's shape: "
                       "adjust_lr(lr, shapes[i], adjust_lr_fn)",
}


def _far(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    """The largest difference, as a fraction of the largest movement from the start."""
    moved = (want - start).abs().max().item()
    return (got - want).abs().max().item() / max(moved, 1e-30)


def _shards_problem(n: int, per_rank: list) -> str | None:
    want, _ = _shards_oracle()
    st, S, k = _starts(), _shard_len(n), len(SHARD_SHAPES)
    start = [p.detach() for p in _params(SHARD_SHAPES)]
    steps = [len(res["trajectory"]) for res in per_rank]
    if any(s != SHARD_STEPS for s in steps):
        return f"on {n} ranks: steps recorded per rank {steps}, want {SHARD_STEPS}"
    for t in range(SHARD_STEPS):
        flat = torch.cat([res["trajectory"][t].float().reshape(-1) for res in per_rank])
        if flat.numel() != n * S:
            return (f"on {n} ranks: the shards hold {flat.numel()} elements in all, want "
                    f"{n * S}: update param_shard in place, keeping its length")
        got = [flat[st[i]:st[i + 1]].view(SHARD_SHAPES[i]) for i in range(k)]
        for i in range(k):
            if bool(torch.isfinite(got[i]).all()) and _far(got[i], want[t][i], start[i]) <= SHARD_TOL:
                continue
            at = (f"on {n} ranks (owners {_shard_owners(n)}), after step {t + 1}, matrix {i} "
                  f"{SHARD_SHAPES[i]}, put back together from the shards")
            before = want[t - 1][i] if t else start[i]
            g, w = got[i].reshape(-1), want[t][i].reshape(-1)
            for j in range(n):  # a rank whose piece did not move, or only decayed
                a, b = max(st[i], j * S) - st[i], min(st[i + 1], (j + 1) * S) - st[i]
                if a >= b or _far(g[a:b], w[a:b], before.reshape(-1)[a:b]) <= SHARD_TOL:
                    continue
                prev = (per_rank[j]["trajectory"][t - 1] if t else
                        _flat(start, n)[j * S:(j + 1) * S]).float()[a + st[i] - j * S:b + st[i] - j * S]
                decay = 1 - SHARD_KW["lr"] * SHARD_KW["weight_decay"]
                if torch.equal(g[a:b], prev) or torch.allclose(g[a:b], prev * decay):
                    return (f"{at}: on rank {j}, which holds its elements [{a}, {b}), it did not "
                            f"move{' (only decayed)' if not torch.equal(g[a:b], prev) else ''}: "
                            f"its owner, rank {_shard_owners(n)[i]}, must send each rank the piece "
                            "of the update that lies in its shard, and that rank applies it there")
            for mistake, why in SHARD_MISTAKES.items():
                if _far(got[i], _shards_oracle(mistake)[0][t][i], start[i]) <= SHARD_TOL:
                    return f"{at} differs from torch.optim.Muon's on the whole matrix: {why}"
            m = int((g - w).abs().argmax())
            return (f"{at} differs from torch.optim.Muon's on the whole matrix by "
                    f"{_far(got[i], want[t][i], start[i]):.3g} of how far it moved (tolerance "
                    f"{SHARD_TOL}): element {m} is {g[m].item():.6g}, want {w[m].item():.6g}. Is "
                    "each piece where the layout puts it (matrix i starts at the sum of the "
                    "earlier matrices' sizes; rank r holds [r*S, (r+1)*S))?")
    return None


def _shard_ranks(impl):
    return H.per_world_size(_shards_results(impl), "shards", WORLD_SIZES)


def _updates_not_carried(n: int, per_rank: list) -> str | None:
    """None when every piece of update a rank applied to a matrix another rank owns came in
    the owner's recorded sends of that step: the update the piece's movement implies
    ((before x (1 - lr wd) - after) / the adjusted lr) is, to rounding, a run of what the
    owner put into its messages and collectives."""
    st, S, owners = _starts(), _shard_len(n), _shard_owners(n)
    decay = 1 - SHARD_KW["lr"] * SHARD_KW["weight_decay"]
    start = _flat([p.detach() for p in _params(SHARD_SHAPES)], n)
    for t in range(SHARD_STEPS):
        for i, o in enumerate(owners):
            sent = per_rank[o]["sent"][t]
            hay = torch.cat([d.float() for d in sent]) if sent else torch.zeros(0)
            alpha = SHARD_KW["lr"] * _lr_factor(SHARD_SHAPES[i], None)
            for j, res in enumerate(per_rank):
                a, b = max(st[i], j * S), min(st[i + 1], (j + 1) * S)
                if j == o or a >= b:
                    continue
                before = (res["trajectory"][t - 1] if t else start[j * S:(j + 1) * S]).float()
                after = res["trajectory"][t].float()
                piece = slice(a - j * S, b - j * S)
                implied = (before[piece] * decay - after[piece]) / alpha
                if not _near_run(hay, implied):
                    return (f"on {n} ranks (owners {owners}), step {t}: rank {j} moved its piece of "
                            f"matrix {i} (elements [{a - st[i]}, {b - st[i]})) by an update that is in "
                            f"none of the messages or collectives its owner, rank {o}, issued in that "
                            "step (the grader records what each rank sends): each rank's piece of the "
                            "update comes from the owner in them, not another way")
    return None


def _near_run(hay: torch.Tensor, needle: torch.Tensor) -> bool:
    """Does `hay` hold a run equal to `needle` within float32 rounding of the step?"""
    L = needle.numel()
    if L == 0:
        return True
    tol = 1e-3 * max(float(needle.abs().max()), 1e-6)
    for k in ((hay[:max(0, hay.numel() - L + 1)] - needle[0]).abs() <= tol).nonzero().reshape(-1).tolist():
        if bool(((hay[k:k + L] - needle).abs() <= tol).all()):
            return True
    return False


@check("07", points=3, name="Muon on shards, 2 and 3 ranks: the shards put together == torch.optim.Muon "
                            "on the whole matrices (within 1% of the movement: bf16)")
def _shards_equal(impl):
    H.first_problem(_shards_problem(n, per_rank) for n, per_rank in _shard_ranks(impl))
    for n, per_rank in _shard_ranks(impl):
        H.first_problem([res["carried"] for res in per_rank] + [_updates_not_carried(n, per_rank)])


@check("07", points=2, name="Muon on shards: each matrix's momentum whole, on its owner only")
def _shards_momentum(impl):
    start = {i: torch.zeros(s) for i, s in enumerate(SHARD_SHAPES)}
    for n, per_rank in _shard_ranks(impl):
        _, want = _shards_oracle()
        owners = _shard_owners(n)
        for r, res in enumerate(per_rank):
            kept = res["momenta"]
            mine = [i for i in range(len(SHARD_SHAPES)) if owners[i] == r]
            extra = sorted(set(kept) - set(mine), key=str)
            assert not extra, (
                f"on {n} ranks (owners {owners}), rank {r} keeps momenta for {extra}, which it does "
                "not own: only the owner keeps a matrix's momentum (1/N of the state per rank)")
            for i in mine:
                assert i in kept, (
                    f"on {n} ranks (owners {owners}), rank {r} owns matrix {i} but keeps no "
                    f"momenta[{i}]: the owner keeps it across steps, buf.lerp_(grad, 1 - momentum)")
                got = kept[i]
                assert isinstance(got, torch.Tensor) and tuple(got.shape) == SHARD_SHAPES[i], (
                    f"on {n} ranks, rank {r}: momenta[{i}] is "
                    f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
                    f"want the whole matrix, shape {SHARD_SHAPES[i]}")
                err = _far(got.float(), want[i], start[i])
                assert err <= SHARD_TOL, (
                    f"on {n} ranks, rank {r}: momenta[{i}] differs from torch.optim.Muon's "
                    f"momentum_buffer by {err:.3g} of its size after {SHARD_STEPS} steps: "
                    "buf.lerp_(grad, 1 - momentum) once per step, on the whole averaged gradient")


@check("07", points=2, name="Muon on shards: bytes received per rank <= its owned matrices' gradient "
                            "pieces (fp32) + its shard's update pieces (bf16) + 64 per matrix")
def _shards_bytes(impl):
    for n, per_rank in _shard_ranks(impl):
        need, bound = _must_receive(n), _shard_bound(n)
        for r, res in enumerate(per_rank):
            got = sum(res["received"].values())
            assert 0 < got or need[r] == (0, 0), (
                f"on {n} ranks, rank {r} received nothing through torch.distributed's "
                "collectives or recv, but it must receive some gradient and update pieces")
            if got <= SHARD_STEPS * bound[r]:
                continue
            by = {k: v for k, v in res["received"].items() if v}
            (g, u) = need[r]
            raise AssertionError(
                f"on {n} ranks (owners {_shard_owners(n)}), rank {r} received {got} bytes in "
                f"{SHARD_STEPS} steps ({by}); the bound is {SHARD_STEPS} x (4 x {g} + 2 x {u} + "
                f"{SHARD_FLAG_BYTES} x {len(SHARD_SHAPES)}) = {SHARD_STEPS * bound[r]}: per step "
                f"it must receive {g} gradient elements (fp32: of the matrices it owns, those "
                f"outside its shard) and {u} update elements (bf16, ns_dtype: of its shard, "
                "those of matrices others own). Send each rank only its pieces, exactly "
                "(all_to_all_single with split sizes), the updates in ns_dtype; no whole shard "
                "or whole update to every rank")


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
    "Put together, in this order: convert to dtype, transpose a tall matrix, give a batch "
    "the (batch, m, n) shape the batched products want, normalise each matrix by its own "
    "clamped norm, iterate with the products of the previous hint, then undo the reshape "
    "and the transpose. Which of these would change the caller's G if done in place?")
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

_SHARDS_LAYOUT = (
    "Muon on shards: write down where everything lies first, the same on every rank. "
    "start[i] = the sum of the earlier matrices' rows x cols; S = param_shard.numel(); "
    "matrix i's piece in rank j's shard is [max(start[i], j*S), min(start[i+1], (j+1)*S)) "
    "in flat coordinates (empty when the first is not below the second); in rank j's "
    "shard it starts at that minus j*S. Each piece travels once: to the owner as "
    "gradient, back from the owner as update.")
_SHARDS_ALL_TO_ALL = (
    "One dist.all_to_all_single(out, inp, out_sizes, in_sizes) per direction. Gradients: "
    "inp is, for j = 0..N-1 in order, the pieces of my shard that belong to matrices rank j "
    "owns (in matrix order), concatenated; in_sizes[j] their total; out_sizes[j] the total "
    "of the pieces of MY matrices in rank j's shard. What arrives from rank j comes in "
    "matrix order, and ranks in order give each matrix's elements in order: torch.cat its "
    "pieces and .view(shape). Updates go back the same way with the sizes swapped.")
_SHARDS_RECIPE = (
    "Put together: the gradient pieces to their owners (one all_to_all_single); on each "
    "owner, for each of its matrices, the momentum kept in momenta and the Newton-Schulz, "
    "as in part (b); the update pieces back (a second all_to_all_single, received in "
    "ns_dtype); on every rank, for each piece it holds, the decay and the adjusted step, "
    "applied to that slice of param_shard in place. Every size comes from shapes and "
    "owners alone, the same on every rank.")

# hints that several checks share
_HINT_STEP = (
    "step on N ranks: every rank computes the same dealing of the matrices (by size, "
    "largest first, in rounds of N), runs _update only for its own, and joins one "
    "all_gather per round, into which each owner puts its update (or a flag saying there "
    "is none) and out of which every rank applies every update that came, with "
    "self._apply. A rank that owns nothing in a round still joins it, with the same sizes.")

HINTS = {
    "_singular_values": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_tall": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_batched": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_dtype": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_zeros": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_bitwise": [_NS_ITERATION, _NS_TALL_BATCH, _NS_BITS, _NS_RECIPE],
    "_one_process": [
        _MUON_ONE,
        "_update: the momentum buffer lives in self.state[p]['momentum_buffer'] (zeros at "
        "first); average the gradient into it, take the Nesterov look-ahead when the group "
        "asks for it, and orthogonalise the result with ns_reference in self.ns_dtype. "
        "self._apply then does the weight decay and the shape-adjusted step.",
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
    "_shards_equal": [_SHARDS_LAYOUT, _SHARDS_ALL_TO_ALL, _SHARDS_RECIPE],
    "_shards_momentum": [
        "Only the owner of matrix i keeps momenta[i], the whole matrix (rows x cols), created "
        "as zeros at the first step and updated in place with buf.lerp_(grad, 1 - momentum), "
        "where grad is the whole averaged gradient the owner put together from the pieces.",
        _SHARDS_RECIPE,
    ],
    "_shards_bytes": [
        "Count what must reach rank r per step: the pieces, outside its shard, of the matrices "
        "it owns, and the pieces, inside its shard, of the matrices others own. Anything more "
        "(a whole shard to every rank, a whole update broadcast, padding to the largest "
        "piece) is over the bound.",
        _SHARDS_ALL_TO_ALL,
        _SHARDS_RECIPE,
    ],
}
