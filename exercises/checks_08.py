"""Graded checks of exercise 08 (exercises/08_at_scale.py), registered with exercises.grade.

pieces_of and read are checked in this process. The oracle of pieces_of is a unit built
here by hand: each parameter's elements hold a code (which parameter, which element), the
parameters are laid out sorted by group, padded, and cut into N shards; a piece is right
when the elements it names hold exactly the codes it claims, and the pieces of all ranks
together hold every element of every parameter once. read is given pieces cut here from
known tensors, in shuffled order, with and without gaps.

save and load run where they must: in processes started by minidist.launch.launch (gloo),
one launch per world size for every part (see exercises/_harness.py), sharing one folder
of checkpoints. A small GPT (AdamW, two param groups, a learning rate that changes every
step) trains with minidist's ShardedOptimizer: ZeRO-2 on 4 ranks saves at step S; ZeRO-1
on 2 ranks loads it, trains one step and saves; ZeRO-2 on 3 ranks loads that and trains
to T; 1 rank loads the 4-rank checkpoint and trains to T. The oracles: what the saving
ranks held (load must put it back bit for bit: weights, both AdamW moments reassembled
from every rank's shards, AdamW's step counter); one process training with plain AdamW
on the whole batches (the resumed runs must continue as it does, up to float32 rounding:
on another number of ranks the gradients are averaged in another order); and, with
dropout on the same 4 ranks, the same run uninterrupted (equal to the bit: the same
arithmetic, if each rank gets its RNG state back). The bytes each torch.save call writes
are counted (the distinct storages of its floating-point tensors: what torch.save puts on
disk). The kill is simulated in one process: torch.save, Path.write_text/write_bytes,
json.dump, os.replace and os.rename are wrapped so that a SimulatedKill (a BaseException:
nothing catches it, as nothing catches a SIGKILL) interrupts the save at each moment in
turn, a file cut to half its length when the kill lands while it is written.

The reference is minidist.checkpoint, through the adapters at the end of this file.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import operator
import os
import pathlib
import random
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from exercises import _harness as H
from exercises import _rules
from exercises.grade import check

TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung; tests lower it
HANG_HINT = ("save and load are collectives: every rank calls them, with the same barriers in "
             "the same order; only rank 0 creates and renames the folder.")
# n_embd 10 and vocabulary 53: units of odd lengths, padded at 3 and at 4 ranks
CFG = dict(n_layer=2, n_head=2, n_embd=10, block_size=7, vocab_size=53)
CAP_MB = 0.003      # about 800 floats per unit: 6 units, matrices and vectors mixed
B = 12              # sequences per global batch: 1, 2, 3 and 4 ranks divide it
S, T = 2, 5         # the 4-rank run saves at step S; the resumed runs train to step T
LR = 1e-2
# eps 1e-4, not 1e-8: the key projection's bias has an exactly zero gradient (softmax
# ignores a shift shared by all keys), so what arrives is rounding noise, which Adam with
# a tiny eps would blow up to +-lr differently for every summation order
ADAMW = dict(lr=LR, betas=(0.9, 0.95), eps=1e-4)
DROPOUT = 0.1       # in the same-world-size run only: each rank's masks come from its RNG
# float32 after T AdamW steps, the gradients averaged over 1, 2, 3 or 4 ranks in another
# order: equal up to rounding, as in tests/test_zero.py and tests/test_checkpoint.py
RTOL, ATOL = 1e-5, 1e-6
CODE = 1_000_000    # pieces_of's oracle: element j of parameter k holds CODE * (k + 1) + j

# The exercise's rules, watched in every check and part while the learner's code runs
# (exercises/_rules.py): the sharded format is yours, written with torch.save.
_OWN_FORMAT = ("exercise 08 writes its own sharded checkpoint with torch.save and torch.load, "
               "not torch.distributed.checkpoint")
# minidist's modules for this exercise's idea: the learner's file may not name them
# (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.checkpoint", "minidist.checkpoint.io", "minidist.checkpoint.schema", "minidist.checkpoint.slots", "minidist.checkpoint.resume")
RULES = _rules.Rules(apis={f"torch.distributed.checkpoint.{name}": _OWN_FORMAT
                           for name in ("save", "load", "save_state_dict", "load_state_dict",
                                        "async_save")})


def _name(step: int) -> str:
    return f"step_{step:08d}"


# ============================================================================ part 1: pieces_of

def _by_hand(layout, world: int, grouped: bool = True):
    """The unit's padded flat buffer, built here (float64 codes, 0 = padding), and S."""
    order = sorted(range(len(layout)), key=lambda k: layout[k][2]) if grouped else range(len(layout))
    flat = torch.cat([CODE * (k + 1) + torch.arange(layout[k][1], dtype=torch.float64) for k in order])
    chunk = -(-flat.numel() // world)
    return torch.cat([flat, torch.zeros(chunk * world - flat.numel(), dtype=torch.float64)]), chunk


def _held(flat, i: int, names) -> str:
    v = int(flat[i])
    return "padding" if v == 0 else f"{names[v // CODE - 1]}'s element {v % CODE}"


def _layout_text(layout) -> str:
    return "[" + ", ".join(f"({n!r}, {k}, {g})" for n, k, g in layout) + "]"


def _piece(p, names):
    """(name, start, a, b) with integer numbers, or None."""
    try:
        name, *nums = p
        nums = [operator.index(x) for x in nums]
    except (TypeError, ValueError):
        return None
    return (name, *nums) if len(nums) == 3 and name in names else None


def _pieces_problem(impl, layout, world: int) -> str | None:
    flat, chunk = _by_hand(layout, world)
    ungrouped, _ = _by_hand(layout, world, grouped=False)
    names = [e[0] for e in layout]
    total = sum(e[1] for e in layout)
    where = {}  # flat element -> the (rank, piece)s that claim it
    for r in range(world):
        lo, hi = r * chunk, (r + 1) * chunk
        call = f"pieces_of({_layout_text(layout)}, rank={r}, world={world})"
        got = impl.pieces_of([tuple(e) for e in layout], r, world)  # copies: ours stay ours
        try:
            pieces = list(got)
        except TypeError:
            return f"{call} returned {got!r}; want a list of (name, start, a, b)"
        for p in pieces:
            q = _piece(p, names)
            if q is None:
                return f"{call} gave {p!r}; want (name, start, a, b): a name of the layout, three ints"
            name, start, a, b = q
            if a >= b:
                return (f"{call} gave the empty piece {q}: leave out a parameter with no "
                        "element on this rank")
            if a < lo or b > hi:
                why = (f"(r+1)*S = {hi} is the next rank's first element: the end is excluded, "
                       f"[{lo}, {hi}) holds {hi - lo} elements" if b == hi + 1 else
                       f"the buffer is padded to S * N = {chunk * world}, so that every rank holds "
                       f"S elements; total // N = {total // world} would leave the last ones out")
                return (f"{call} gave {q}, which reaches outside this rank's elements [{lo}, "
                        f"{hi}) of the unit, [r*S, (r+1)*S) with S = ceil(total / N) = "
                        f"ceil({total} / {world}) = {chunk}: {why}")
            k = names.index(name)
            want = CODE * (k + 1) + start + torch.arange(b - a, dtype=torch.float64)
            if not torch.equal(flat[a:b], want):
                bucket = torch.equal(ungrouped[a:b], want)
                return (f"{call} gave {q}, but elements [{a}, {b}) of the unit hold "
                        f"{_held(flat, a, names)} to {_held(flat, b - 1, names)}, not {name}'s "
                        f"elements [{start}, {start + b - a})"
                        + (": that is where they would be in bucket order, but a unit lays its "
                           "parameters out sorted by param group (a stable sort)" if bucket else
                           ": start is where the overlap begins within the parameter, a - "
                           "(the parameter's offset in the unit)"))
            for i in range(a, b):
                where.setdefault(i, []).append((r, q))
    for i in range(flat.numel()):
        claims = where.get(i, [])
        if len(claims) > 1:
            return (f"pieces_of({_layout_text(layout)}, rank, world={world}): element {i} of the "
                    f"unit ({_held(flat, i, names)}) is in {len(claims)} pieces, "
                    + ", ".join(f"rank {r}'s {q}" for r, q in claims)
                    + ": each element belongs to exactly one rank's shard, [r*S, (r+1)*S) "
                    "(the end excluded), and to one piece there")
        if not claims and flat[i] != 0:
            return (f"pieces_of({_layout_text(layout)}, rank={i // chunk}, world={world}): "
                    f"element {i} of the unit ({_held(flat, i, names)}) is in no piece, yet "
                    f"that rank holds [{i // chunk * chunk}, {(i // chunk + 1) * chunk}) "
                    f"(S = ceil({total} / {world}) = {chunk})")
    return None


ONE_GROUP = [  # (layout, world sizes): every N divides the unit, one param group
    ([("w", 6, 0), ("b", 10, 0), ("c", 4, 0), ("d", 12, 0)], (1, 2, 4, 8)),  # d spans 3 ranks at 8
    ([("a", 30, 0)], (3, 5, 6)),
]
PADDED_GROUPED = [  # padding, param groups interleaved in bucket order
    ([("m1", 7, 0), ("v1", 3, 1), ("m2", 5, 0), ("v2", 2, 1), ("m3", 4, 0)], (2, 3, 4, 5)),
    ([("x", 6, 1), ("y", 4, 0)], (3, 4, 7)),  # at 7 ranks, ranks 5 and 6 hold only padding
    ([("g", 5, 2), ("h", 9, 0), ("e", 1, 1), ("k", 8, 0)], (2, 3, 6)),
]


@check("08", points=2, name="pieces_of, one param group, N divides the unit: each rank's pieces "
                            "are its shard's elements, every element once")
def _pieces_one_group(impl):
    H.first_problem(_pieces_problem(impl, lay, n) for lay, ns in ONE_GROUP for n in ns)


@check("08", points=2, name="pieces_of, padding (N does not divide) and param groups (layout "
                            "sorted by group)")
def _pieces_padded(impl):
    H.first_problem(_pieces_problem(impl, lay, n) for lay, ns in PADDED_GROUPED for n in ns)


# ============================================================================ part 2: read

def _cut(x: torch.Tensor, cuts, seed: int, leave_out=()):
    """Pieces [(start, clone)] of x at the cut points, shuffled; `leave_out`: their indices."""
    pieces = [(a, x[a:b].clone()) for i, (a, b) in enumerate(zip(cuts, cuts[1:])) if i not in leave_out]
    random.Random(seed).shuffle(pieces)
    return pieces


@check("08", points=2, name="read: a range put together from the pieces that overlap it")
def _read_assembles(impl):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(40, generator=g, dtype=torch.float64)
    y = torch.arange(10, dtype=torch.int64) * 3 + 1
    z = torch.randn(12, generator=g).to(torch.bfloat16)
    pieces = {"optim/w/exp_avg": _cut(x, [0, 7, 8, 20, 33, 40], 1),
              "model/w": _cut(y, [0, 6, 10], 2), "model/z": [(0, z.clone())]}
    full = {"optim/w/exp_avg": x, "model/w": y, "model/z": z}
    for key, start, n in [("optim/w/exp_avg", 0, 40), ("optim/w/exp_avg", 7, 1),
                          ("optim/w/exp_avg", 5, 10), ("optim/w/exp_avg", 8, 12),
                          ("optim/w/exp_avg", 21, 19), ("optim/w/exp_avg", 39, 1),
                          ("optim/w/exp_avg", 12, 3), ("model/w", 4, 5), ("model/w", 0, 10),
                          ("model/z", 3, 6)]:
        call = f"read(pieces, {key!r}, start={start}, n={n})"
        want = full[key][start:start + n]
        hint = ("from a piece (s, t) that overlaps [start, start + n) in [a, b), copy t[a - s:b - "
                "s] into out[a - start:b - start]")
        try:
            got = impl.read(pieces, key, start, n)
        except NotImplementedError:
            raise
        except (RuntimeError, IndexError, ValueError) as e:
            spans = sorted((s, s + t.numel()) for s, t in pieces[key])
            raise AssertionError(f"{call} raised {type(e).__name__}: {e} (the pieces hold "
                                 f"{spans}, every element of it): {hint}") from None
        assert torch.is_tensor(got), f"{call} returned {type(got).__name__}; want a tensor"
        assert got.dtype == want.dtype, f"{call} returned {got.dtype}; want the pieces' {want.dtype}"
        assert tuple(got.shape) == (n,), f"{call} returned shape {tuple(got.shape)}; want ({n},)"
        if not torch.equal(got, want):
            i = int((got != want).nonzero()[0])
            spans = sorted((s, s + t.numel()) for s, t in pieces[key])
            raise AssertionError(
                f"{call}: element {start + i} of {key} came out {got[i].item():.6g}, want "
                f"{want[i].item():.6g} (the pieces hold {spans}): {hint}")
    for key in full:  # and the pieces are left as they were
        assert torch.equal(torch.cat([t for _, t in sorted(pieces[key], key=lambda e: e[0])]), full[key]), \
            f"read changed the pieces of {key}: copy out of them, never into them"


@check("08", points=1, name="read: ValueError when an element of the range is in no piece")
def _read_gaps(impl):
    z = torch.arange(30, dtype=torch.float32)
    pieces = {"g": _cut(z, [0, 2, 12, 15, 27, 30], 3, leave_out={0, 2, 4})}  # no [0,2) [12,15) [27,30)
    spans = sorted((s, s + t.numel()) for s, t in pieces["g"])
    for start, n in [(0, 30), (0, 3), (10, 5), (11, 2), (14, 1), (26, 2), (29, 1)]:
        call = f"read(pieces, 'g', start={start}, n={n})"
        try:
            got = impl.read(pieces, "g", start, n)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as e:
            raise AssertionError(f"{call} raised {type(e).__name__} ({e}), but the pieces hold "
                                 f"only {spans}: for an element in no piece raise ValueError") from None
        raise AssertionError(
            f"read(pieces, 'g', start={start}, n={n}) returned {got!r} (a tensor of "
            f"{getattr(got, 'numel', lambda: '?')()} elements), but the pieces hold only {spans}: "
            "an element in no piece means a damaged checkpoint; raise ValueError, never "
            "return what torch.empty happened to hold (or zeros) in its place")
    for start, n in [(2, 10), (15, 12), (5, 3), (20, 7)]:
        try:  # (what it returns, or a crash, is the other check's business)
            impl.read(pieces, "g", start, n)
        except ValueError as e:
            raise AssertionError(f"read(pieces, 'g', start={start}, n={n}) raised ValueError "
                                 f"({e}), but the pieces {spans} hold every element of it: raise "
                                 "only for an element of [start, start + n) in no piece") from None
        except NotImplementedError:
            raise
        except Exception:
            pass
    try:
        impl.read(pieces, "not/there", 0, 1)
    except (KeyError, ValueError):
        pass
    else:
        raise AssertionError("read(pieces, 'not/there', 0, 1) returned something for a key that "
                             "has no piece at all; raise KeyError (or ValueError)")


# ============================================================================ the training, on every rank

class _AdamW(torch.optim.AdamW):
    """torch.optim.AdamW, its step() the same function without the wrappers that import
    torch._dynamo on the first step (seconds per rank here) for a compiler that nothing
    here runs, and run step hooks (there are none). The same arithmetic."""

    @torch.no_grad()
    def step(self, closure=None):
        return inspect.unwrap(torch.optim.AdamW.step)(self, closure)


def _model(dropout: float = 0.0):
    from minidist.model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG, dropout=dropout))


def _groups(model) -> list[dict]:
    """Matrices with weight decay, vectors without: in the model's order the two groups
    alternate, so each unit's layout (sorted by group) differs from its bucket order."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _lr(step: int) -> float:
    return LR * (1 - step / (2 * T))  # a function of the step: a wrong step shows


def _batch(step: int, r: int, n: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG["vocab_size"], (B, CFG["block_size"] + 1), generator=g)
    x = x[r * B // n:(r + 1) * B // n]
    return x[:, :-1], x[:, 1:]


def _setup(dropout: float, stage: int):
    from minidist.zero import ShardedOptimizer
    model = _model(dropout)
    opt = ShardedOptimizer(_groups(model), _AdamW, stage=stage, reduce_gradients=True,
                           bucket_cap_mb=CAP_MB, module=model, **ADAMW)
    return model, opt


def _train(model, opt, first: int, last: int, r: int, n: int) -> None:
    for step in range(first, last):
        for g in opt.param_groups:
            g["lr"] = _lr(step)
        x, y = _batch(step, r, n)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()


def _params(model) -> dict:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _unit_states(opt, names: dict) -> list[dict]:
    """What this rank's inner optimizer holds, per unit, read here (not with the
    exercise's helpers): each moment laid out like the shard, and the 0-dim values."""
    out = []
    for u in opt.units:
        flats, scalars = {}, set()
        for view, unit, a in opt.shard_views:
            if unit is not u:
                continue
            for k, t in opt.state.get(view, {}).items():
                if torch.is_tensor(t) and t.dim() > 0:
                    flat = flats.setdefault(k, torch.zeros(u.chunk, dtype=t.dtype))
                    flat[a:a + view.numel()] = t.reshape(-1)
                else:
                    scalars.add((k, float(t)))
        out.append({"flats": flats, "scalars": sorted(scalars), "chunk": u.chunk,
                    "params": [(names[id(p)], p.numel()) for p in u.params]})
    return out


def _snapshot(model, opt) -> dict:
    names = {id(p): k for k, p in model.named_parameters()}
    return {"params": _params(model), "units": _unit_states(opt, names)}


def _float_bytes(obj) -> tuple[int, int]:
    """What torch.save writes of obj's floating-point tensors (each distinct storage, whole),
    and the bytes of the tensors themselves (less, where a view of a larger one is saved)."""
    storages, tensors, todo = {}, {}, [obj]
    while todo:
        o = todo.pop()
        if torch.is_tensor(o):
            if o.is_floating_point():
                s = o.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
                tensors[s.data_ptr(), o.storage_offset(), o.numel()] = o.numel() * o.element_size()
        elif isinstance(o, dict):
            todo += list(o.keys()) + list(o.values())
        elif isinstance(o, (list, tuple, set)):
            todo += list(o)
    return sum(storages.values()), sum(tensors.values())


@contextlib.contextmanager
def _counting_saves():
    seen = {"bytes": 0, "tensor_bytes": 0, "calls": 0}
    real = torch.save

    def counted(obj, f, *args, **kwargs):
        written, own = _float_bytes(obj)
        seen["calls"] += 1
        seen["bytes"] += written
        seen["tensor_bytes"] += own
        return real(obj, f, *args, **kwargs)

    torch.save = counted
    try:
        yield seen
    finally:
        torch.save = real


def _oracle_part(root, fns, r: int, n: int):
    """One process, plain AdamW, the whole batch: the parameters after every step."""
    H.skip_dynamo_import()
    model = _model()
    opt = _AdamW(_groups(model), **ADAMW)
    out = {0: _params(model)}
    for step in range(T):
        for g in opt.param_groups:
            g["lr"] = _lr(step)
        x, y = _batch(step, 0, 1)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        out[step + 1] = _params(model)
    return out


MOVED_LIMIT = 12 * 1024  # bytes a rank may receive through collectives in one save or load
_CALLS = [0]


@contextlib.contextmanager
def _one_call(what: str):
    """The learner's save or load runs in here: its collectives (recorded below
    torch.distributed's Python, exercises/_traffic.py) are labelled with this call."""
    _CALLS[0] += 1
    with H.traffic().phase_of((what, _CALLS[0])):
        yield


def _most_moved() -> tuple[int, str]:
    """(bytes, "save" or "load"): the most this rank received through collectives in one
    call of the learner's save or load in this part."""
    per: dict = {}
    for e in H.traffic().events:
        if isinstance(e.phase, tuple) and e.phase[0] in ("save", "load"):
            per[e.phase] = per.get(e.phase, 0) + e.received
    if not per:
        return 0, "save"
    phase = max(per, key=per.get)
    return per[phase], phase[0]


def _save_part(dst: str, stage: int, root, fns, r: int, n: int) -> dict:
    """Train steps [0, S) on n ranks, save with the exercise's save."""
    H.skip_dynamo_import()
    model, opt = _setup(0.0, stage)
    _train(model, opt, 0, S, r, n)
    out = {"saved": _snapshot(model, opt)}
    with _counting_saves() as seen, _one_call("save"):
        fns["save"](str(Path(root) / dst), S, model, opt)
    out.update(seen, moved=_most_moved())
    return out


def _resume_part(src: str, saved_at: int, last: int, stage: int, dst: str | None,
                 root, fns, r: int, n: int) -> dict:
    """Load src's checkpoint of step `saved_at` on n ranks, train to `last`; save there."""
    H.skip_dynamo_import()
    path = Path(root) / src / _name(saved_at)
    if not path.is_dir():
        return {"skipped": f"there is no {src}/{_name(saved_at)} to load: the save before failed "
                           "(see its checks)"}
    model, opt = _setup(0.0, stage)
    torch.manual_seed(1234 + r)  # a restarted process: its own RNG state
    with _one_call("load"):
        step = fns["load"](str(path), model, opt)
    out = {"step": step, "loaded": _snapshot(model, opt), "train_error": None, "moved": _most_moved()}
    if not isinstance(step, int):
        out["train_error"] = f"load returned {step!r}, not a step, so training could not continue"
        return out
    try:
        _train(model, opt, step, last, r, n)
    except Exception as e:  # e.g. a state AdamW cannot use
        out["train_error"] = f"{type(e).__name__}: {e}"
        return out
    out["final"] = _params(model)
    if dst:
        out["saved"] = _snapshot(model, opt)
        with _counting_saves() as seen, _one_call("save"):
            fns["save"](str(Path(root) / dst), last, model, opt)
        out.update(seen, moved=_most_moved())
    return out


def _same_part(root, fns, r: int, n: int) -> dict:
    """With dropout, each rank seeded apart: T steps uninterrupted; then S steps, save, a
    fresh model and optimizer in a process whose RNG is elsewhere, load, train to T."""
    H.skip_dynamo_import()
    model, opt = _setup(DROPOUT, 1)
    torch.manual_seed(100 + r)
    _train(model, opt, 0, T, r, n)
    want = _params(model)
    model, opt = _setup(DROPOUT, 1)
    torch.manual_seed(100 + r)
    _train(model, opt, 0, S, r, n)
    with _one_call("save"):
        fns["save"](str(Path(root) / "same"), S, model, opt)
    rng = torch.get_rng_state()
    model, opt = _setup(DROPOUT, 1)
    torch.manual_seed(4321)  # a restarted process
    with _one_call("load"):
        step = fns["load"](str(Path(root) / "same" / _name(S)), model, opt)
    out = {"want": want, "step": step, "rng_restored": torch.equal(torch.get_rng_state(), rng),
           "scalars": sorted({s for u in _snapshot(model, opt)["units"] for s in u["scalars"]}),
           "train_error": None}
    try:
        _train(model, opt, step if isinstance(step, int) else S, T, r, n)
    except Exception as e:
        out["train_error"] = f"{type(e).__name__}: {e}"
    out["got"] = _params(model)
    return out


# ---- the kill, simulated

class SimulatedKill(BaseException):
    """The grader's kill, raised inside save. A BaseException, so that `except Exception`
    does not catch it: nothing catches a SIGKILL."""


def _short(target) -> str:
    """The last two parts of a path (or what a file object says it is)."""
    if isinstance(target, (str, os.PathLike)):
        return "/".join(Path(target).parts[-2:])
    return str(getattr(target, "name", type(target).__name__))


def _truncate(target) -> None:
    """Cut a file just written to half its length: what a kill mid-write leaves."""
    try:
        if isinstance(target, (str, os.PathLike)):
            os.truncate(target, os.path.getsize(target) // 2)
        elif hasattr(target, "truncate"):
            target.flush()
            target.truncate(target.tell() // 2)
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def _kill_points(kill_at: int | None):
    """Wrap what writes and renames files; each moment a kill could land at is a point
    (described in words); raise SimulatedKill at point number `kill_at`. Yields the
    list of points passed."""
    points, undo = [], []

    def point(what: str) -> None:
        points.append(what)
        if kill_at == len(points) - 1:
            raise SimulatedKill(what)

    def writer(owner, attr, label, target_of, mid_write=True):
        real, calls = getattr(owner, attr), [0]

        def wrapped(*args, **kwargs):
            calls[0] += 1
            target = target_of(args, kwargs)
            what = f"{label} #{calls[0]} ({_short(target)})"
            out = real(*args, **kwargs)
            if mid_write:
                if kill_at == len(points):
                    _truncate(target)
                point(f"while {what} was writing (the file left half written)")
            point(f"just after {what} wrote its file")
            return out

        setattr(owner, attr, wrapped)
        undo.append((owner, attr, real))

    def renamer(attr):
        real = getattr(os, attr)

        def wrapped(src, dst, *args, **kwargs):
            what = f"os.{attr}({_short(src)} -> {_short(dst)})"
            point(f"just before {what}")
            out = real(src, dst, *args, **kwargs)
            point(f"just after {what}")
            return out

        setattr(os, attr, wrapped)
        undo.append((os, attr, real))

    arg = lambda i, name: lambda a, k: a[i] if len(a) > i else k.get(name)  # noqa: E731
    try:
        writer(torch, "save", "torch.save", arg(1, "f"))
        writer(pathlib.Path, "write_text", "Path.write_text", arg(0, "self"))
        writer(pathlib.Path, "write_bytes", "Path.write_bytes", arg(0, "self"))
        writer(json, "dump", "json.dump", arg(1, "fp"), mid_write=False)
        renamer("replace")
        renamer("rename")
        yield points
    finally:
        for owner, attr, real in reversed(undo):
            setattr(owner, attr, real)


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _loads_whole(fns, path: Path, want: dict) -> str | None:
    """None if checkpoint `path` loads (1 rank) the weights `want` (what else load puts
    back, and the step it returns, are other checks' business)."""
    model, opt = _setup(0.0, 2)
    try:
        fns["load"](str(path), model, opt)
    except Exception as e:
        return f"loading it raised {type(e).__name__}: {e}"
    for k, p in model.named_parameters():
        if not torch.equal(p.detach(), want[k]):
            return f"its {k} is not the one saved"
    return None


def _after_kill(fns, d: Path, before: dict, want: dict, where: str, model, opt) -> str | None:
    said = f"a save of step 2 killed {where}"
    prev, new = _name(1), _name(2)
    visible = sorted(e.name for e in d.iterdir() if not e.name.startswith("."))
    if prev not in visible or _files(d / prev) != before:
        return (f"{said} changed the previous checkpoint, {prev}: a save writes only into its "
                "own (hidden) folder")
    stray = [v for v in visible if v not in (prev, new)]
    if stray:
        return (f"{said} left {stray} in the checkpoint folder: anything not yet whole must "
                "have a name that starts with '.' (root/.tmp_step_00000002)")
    if new in visible:
        problem = _loads_whole(fns, d / new, want)
        return None if problem is None else (
            f"{said} left {new} visible, but it is not whole ({problem}): a checkpoint must "
            "appear whole or not at all. Write into a hidden folder, root/.tmp_step_..., and "
            "rename it into place (os.replace) as the last thing, once every rank has written")
    try:
        fns["save"](str(d), 2, model, opt)
    except Exception as e:
        return (f"after {said}, saving step 2 again failed ({type(e).__name__}: {e}): a killed "
                "save leaves its hidden folder behind; empty it first (shutil.rmtree(tmp, "
                "ignore_errors=True)), then create it")
    problem = (f"there is no {new}" if not (d / new).is_dir() else _loads_whole(fns, d / new, want))
    return None if problem is None else (
        f"after {said}, saving step 2 again did not give a whole checkpoint: {problem}")


def _kill_part(root, fns, r: int, n: int) -> dict:
    """On 1 rank: a checkpoint of step 1, then a save of step 2 killed at each moment in
    turn, each in a copy of the folder holding step 1."""
    H.skip_dynamo_import()
    base = Path(root) / "kill"
    model, opt = _setup(0.0, 2)
    _train(model, opt, 0, 1, r, n)
    template = base / "template"
    fns["save"](str(template), 1, model, opt)
    if not (template / _name(1)).is_dir():
        return {"points": [], "problems": [f"save(root, 1, ...) left no root/{_name(1)}: the "
                                           "checkpoint of step s is the folder root/step_{s:08d}"]}
    before = _files(template / _name(1))
    _train(model, opt, 1, 2, r, n)
    want = _params(model)
    count = base / "count"
    shutil.copytree(template, count)
    with _kill_points(None) as points:  # the moments a kill can land at, in a save that runs through
        fns["save"](str(count), 2, model, opt)
    points = [p.replace(f"{count.name}/", "root/") for p in points]  # name the folder as the user would
    if not points:
        return {"points": [], "problems": [
            "the grader saw your save write no file through torch.save (or Path.write_text, "
            "Path.write_bytes, json.dump) and rename nothing with os.replace or os.rename, so "
            "it could not kill it anywhere: write each rank's file with torch.save"]}
    problems = []
    for i, where in enumerate(points):
        d = base / f"kill_{i:03d}"
        shutil.copytree(template, d)
        try:
            with _kill_points(i):
                fns["save"](str(d), 2, model, opt)
        except SimulatedKill:
            pass
        problem = _after_kill(fns, d, before, want, where, model, opt)
        if problem:
            problems.append(problem)
            break
    return {"points": points, "problems": problems}


PARTS = {
    "save4": functools.partial(_save_part, "r4", 2),
    "same": _same_part,
    "resume2": functools.partial(_resume_part, "r4", S, S + 1, 1, "r2"),
    "resume3": functools.partial(_resume_part, "r2", S + 1, T, 2, None),
    "oracle": _oracle_part,
    "resume1": functools.partial(_resume_part, "r4", S, T, 2, None),
    "kill": _kill_part,
}
# one launch per world size, in this order: 4 ranks save, 2 load that and save, 3 load
# that; 1 rank computes the oracle, loads the 4 ranks' checkpoint, and is killed
PLAN = {4: ["save4", "same"], 2: ["resume2"], 3: ["resume3"], 1: ["oracle", "resume1", "kill"]}
# the resumed runs: (ranks, the part whose checkpoint it loads, the step it trains to)
RESUMES = {"resume2": (2, "save4", S + 1), "resume3": (3, "resume2", T), "resume1": (1, "save4", T)}
WORLD_OF = {p: n for n, parts in PLAN.items() for p in parts}


def _preflight(impl) -> str | None:
    """The hint of a stub save or load, found here without starting processes (a launch
    would only bring back the same hint): each is called with nothing to work on."""
    with tempfile.TemporaryDirectory(prefix="minidist-grade-08-") as d:
        for fn, args in ((impl.save, (d, 0, None, None)), (impl.load, (d, None, None))):
            try:
                fn(*args)
            except NotImplementedError as e:
                return str(e)
            except Exception:  # not a stub: for the ranks to show
                pass
    return None


_CACHE = H.Cache()


def _results(impl) -> dict:
    def compute():
        hint = H.preflight(lambda save, load: _preflight(SimpleNamespace(save=save, load=load)),
                           impl.save, impl.load)
        if hint is not None:
            return {(p, n): ("notimpl", hint) for n, parts in PLAN.items() for p in parts}
        with tempfile.TemporaryDirectory(prefix="minidist-grade-08-") as root:
            parts = {p: functools.partial(f, root) for p, f in PARTS.items()}
            return H.run_all(parts, {"save": impl.save, "load": impl.load}, PLAN, TIMEOUT_S,
                             HANG_HINT, RULES)
    return _CACHE.get((impl.save, impl.load, TIMEOUT_S), compute)  # tests change the last one


def _part(impl, name: str) -> list:
    """The part's per-rank results (failing the check, with why, if it did not run)."""
    for _, per_rank in H.per_world_size(_results(impl), name, (WORLD_OF[name],)):
        return per_rank


# ============================================================================ part 3: the checks

def _assemble(units_per_rank: list) -> list[dict]:
    """Every rank's unit states put side by side: per unit {moment: the unit's flat moment,
    padding cut off}, from what each rank held of it."""
    out = []
    for i, unit in enumerate(units_per_rank[0]):
        numel = sum(k for _, k in unit["params"])
        keys = sorted(set().union(*(rank[i]["flats"] for rank in units_per_rank)))
        out.append({k: torch.cat([rank[i]["flats"].get(k, torch.zeros(rank[i]["chunk"]))
                                  for rank in units_per_rank])[:numel] for k in keys})
    return out


def _element(unit: dict, j: int) -> str:
    offset = 0
    for name, k in unit["params"]:
        if j < offset + k:
            return f"{name}'s element {j - offset}"
        offset += k
    return f"element {j}"


def _first_difference(got: dict, want: dict, exact: bool = True) -> str | None:
    for k, w in want.items():
        g = got.get(k)
        if g is None or g.shape != w.shape:
            return f"{k} is {'missing' if g is None else f'shaped {tuple(g.shape)}'}"
        bad = (g != w) if exact else ((g - w).abs() > ATOL + RTOL * w.abs())
        if bad.any():
            j = int(bad.reshape(-1).nonzero()[0])
            return (f"{k}'s element {j} is {g.reshape(-1)[j].item():.8g}, want "
                    f"{w.reshape(-1)[j].item():.8g} ({int(bad.sum())} of {w.numel()} elements "
                    f"differ, by up to {(g - w).abs().max().item():.3g})")
    return None


def _skipped(per_rank: list, where: str) -> None:
    for res in per_rank:
        if res.get("skipped"):
            raise AssertionError(f"{where}: {res['skipped']}")


@check("08", points=2, name="save is atomic: killed at any moment it leaves the previous "
                            "checkpoint untouched and the new one whole or invisible")
def _atomic(impl):
    res = _part(impl, "kill")[0]
    if res["problems"]:
        renamed = any("os.re" in p for p in res["points"])
        raise AssertionError(res["problems"][0] + ("" if renamed else
                             " (your save renamed nothing: a folder written in place is visible "
                             "while it is incomplete)"))


@check("08", points=2, name="save writes each element once: the weights and both AdamW moments, "
                            "12 bytes per parameter element in all")
def _bytes(impl):
    for name, n in (("save4", 4), ("resume2", 2), ("resume3", 3)):
        for r, res in enumerate(_part(impl, name)):
            got, what = res.get("moved", (0, "save"))
            assert got <= MOVED_LIMIT, (
                f"on {n} ranks, rank {r} received {got} bytes through collectives in one call of "
                f"your {what} (the grader records every collective below torch.distributed's "
                f"Python), more than the {MOVED_LIMIT} bytes a few flags and names take: no "
                "rank gathers the model or the moments; every rank writes (and reads) its own "
                "pieces through the files, and the collectives only coordinate")
    for name, n in (("save4", 4), ("resume2", 2)):
        per_rank = _part(impl, name)
        _skipped(per_rank, f"on {n} ranks")
        units = per_rank[0]["saved"]["units"]
        psi = sum(k for u in units for _, k in u["params"])
        padded = sum(u["chunk"] for u in units) * n
        got = [res["bytes"] for res in per_rank]
        total, low, high = sum(got), 12 * psi, 4 * psi + 8 * padded + 1024 * n
        where = (f"on {n} ranks, the torch.save calls wrote {total} bytes of floating-point "
                 f"tensors in all ({' + '.join(map(str, got))}, rank by rank)")
        if not any(res["calls"] for res in per_rank):
            raise AssertionError(f"on {n} ranks, save never called torch.save: write each rank's "
                                 "file with torch.save (the grader counts what it writes)")
        assert total >= low, (
            f"{where}, less than one float32 weight and two AdamW moments for each of the "
            f"{psi} parameter elements (12 x {psi} = {low}): something is not saved")
        if total <= high:  # each element once; then each by the rank whose shard holds it
            mine = 12 * sum(u["chunk"] for u in units) + 1024  # its shards, a step counter
            for r, b in enumerate(got):
                assert b <= mine, (
                    f"on {n} ranks, rank {r} wrote {b} bytes, more than its shards hold (12 "
                    f"bytes x {sum(u['chunk'] for u in units)} elements): every rank writes "
                    "only what it holds, each weight by the rank whose shard holds it; one rank "
                    "writing for the others is the bottleneck a sharded checkpoint avoids")
            continue
        own = sum(res["tensor_bytes"] for res in per_rank)
        if total > own + 1024 * n:
            why = (f"the tensors saved hold only {own} bytes, the rest is the storage of views "
                   "around them: torch.save writes a view's whole storage (u.flat[a:b] saves the "
                   "whole unit). Save .clone() of each slice")
        elif own >= 4 * psi * n:
            why = ("every rank wrote every weight. The weights are replicated, but each element "
                   "must be written once: by the rank whose shard holds it")
        else:
            why = "some elements are written more than once: each by the rank whose shard holds it"
        raise AssertionError(
            f"{where}; want each element once, 12 x {psi} = {low} bytes (up to {high} with the "
            f"moments' padding and AdamW's 4-byte step counters): {why}")


@check("08", points=2, name="load on 2, 3 and 1 ranks puts back exactly what 4 (and 2) ranks "
                            "saved: weights, AdamW moments and step")
def _loaded(impl):
    initial = _params(_model())
    for name, (m, source, _) in RESUMES.items():
        per_rank = _part(impl, name)
        where = f"on {m} rank{'s' if m > 1 else ''}, loading what {WORLD_OF[source]} ranks saved"
        _skipped(per_rank, where)
        src = _part(impl, source)
        saved_step = S if source == "save4" else S + 1
        for r, res in enumerate(per_rank):
            assert res["step"] == saved_step, (
                f"{where}: rank {r}'s load returned {res['step']!r}, want {saved_step}, the step the "
                "checkpoint was saved at (save it; the caller continues from it)")
            got, want = res["loaded"]["params"], src[0]["saved"]["params"]
            problem = _first_difference(got, want)
            if problem:
                # elements still as the model was built, where training had changed them
                stale = any(bool(((got[k] == initial[k]) & (want[k] != initial[k])).any()) for k in want)
                raise AssertionError(
                    f"{where}: after load, rank {r}'s {problem}"
                    + (": some weights are still those the model was built with. The weights are "
                       "replicated under ZeRO-1/2: every rank reads every parameter whole, "
                       "read(pieces, 'model/' + name, 0, p.numel()), not only its shard" if stale else ""))
        saved = _assemble([res["saved"]["units"] for res in src])
        loaded = _assemble([res["loaded"]["units"] for res in per_rank])
        for i, (s_unit, l_unit) in enumerate(zip(saved, loaded)):
            for k, want in s_unit.items():
                got = l_unit.get(k)
                if got is None:
                    raise AssertionError(f"{where}: after load, no rank holds AdamW's {k} for unit "
                                         f"{i}: set_shard_state(opt, u, flats, scalars) for every unit")
                if not torch.equal(got, want):
                    j = int((got != want).nonzero()[0])
                    unit = per_rank[0]["loaded"]["units"][i]
                    chunk = unit["chunk"]
                    raise AssertionError(
                        f"{where}: after load, AdamW's {k} of {_element(unit, j)} (element {j} of "
                        f"unit {i}, held by rank {j // chunk} of {m}) is {got[j].item():.8g}, saved "
                        f"{want[j].item():.8g}: each rank fills flats[k][a - u.lo:b - u.lo] for "
                        f"the pieces of its shard on {m} rank(s), pieces_of(layout, rank, {m}), "
                        "reading whichever saved pieces overlap them")
        want = sorted({s for res in src for u in res["saved"]["units"] for s in u["scalars"]})
        for r, res in enumerate(per_rank):
            got = sorted({s for u in res["loaded"]["units"] for s in u["scalars"]})
            assert got == want, (
                f"{where}: after load, rank {r}'s AdamW holds the 0-dim state {got}, saved {want}: "
                "its step counter must come back as saved, on every shard view (AdamW's bias "
                "correction depends on it)")


@check("08", points=2, name="resumed on 2, 3 and 1 ranks, training continues as one process "
                            "with plain AdamW does (float32 rounding)")
def _continues(impl):
    oracle = _part(impl, "oracle")[0]
    for name, (m, source, last) in RESUMES.items():
        per_rank = _part(impl, name)
        where = f"on {m} rank{'s' if m > 1 else ''}, resumed from what {WORLD_OF[source]} ranks saved"
        _skipped(per_rank, where)
        for r, res in enumerate(per_rank):
            if res["train_error"]:
                raise AssertionError(f"{where}: rank {r} could not train on after load: "
                                     f"{res['train_error']}")
            problem = _first_difference(res["final"], oracle[last], exact=False)
            if problem:
                raise AssertionError(
                    f"{where}: at step {last}, rank {r}'s {problem}, against one process with "
                    f"plain AdamW on the same batches (|diff| <= {ATOL} + {RTOL} |want|: the "
                    "gradients are averaged in another order on another number of ranks, no "
                    "more). Load must put back the weights, the moments and AdamW's step, and "
                    "return the step saved (see the check of what load puts back)")


@check("08", points=2, name="resumed on the same 4 ranks, with dropout: bit for bit the "
                            "uninterrupted run (each rank's RNG state restored)")
def _same_world(impl):
    per_rank = _part(impl, "same")
    where = f"on 4 ranks (dropout {DROPOUT}), saved at step {S}, resumed by a fresh model"
    for r, res in enumerate(per_rank):  # every rank's step, RNG and AdamW state first
        assert res["step"] == S, f"{where}: rank {r}'s load returned {res['step']!r}, want {S}"
        assert res["rng_restored"], (
            f"{where}: after load, rank {r}'s RNG state is not the one it saved: when the "
            "checkpoint was saved by as many ranks as load runs on, rank r restores rank r's own "
            "state (torch.set_rng_state), so dropout draws the masks the uninterrupted run "
            "draws (not rank 0's on every rank: each rank's differs)")
        steps = [v for k, v in res["scalars"] if k == "step"]
        assert steps == [float(S)], (
            f"{where}: after load, rank {r}'s AdamW step counter(s) are {steps}, want [{float(S)}]: "
            "restore it as saved (AdamW's bias correction depends on it)")
    for r, res in enumerate(per_rank):  # then what they trained to
        if res["train_error"]:
            raise AssertionError(f"{where}: rank {r} could not train on after load: {res['train_error']}")
        problem = _first_difference(res["got"], res["want"])
        assert problem is None, (
            f"{where}: at step {T}, rank {r}'s {problem}, against the same 4 ranks uninterrupted: "
            "the same arithmetic, so it must be equal to the bit")


# ============================================================================ the reference, adapted

def reference_pieces_of(layout, rank: int, world: int):
    """minidist.zero.Unit.pieces on a Unit built with this layout (what ZeRO's state_pieces,
    which minidist.checkpoint saves and loads, is made of)."""
    from minidist.zero import Unit
    params = [torch.nn.Parameter(torch.zeros(numel)) for _, numel, _ in layout]
    group_of = {p: g for p, (_, _, g) in zip(params, layout)}
    names = {id(p): name for p, (name, _, _) in zip(params, layout)}
    u = Unit(params, group_of, rank, world)
    return [(names[id(p)], start, a, b) for p, start, a, b in u.pieces(u.lo, u.hi)]


def reference_read(pieces: dict, key: str, start: int, n: int):
    """minidist.checkpoint.Reader.read on these pieces."""
    from minidist.checkpoint import Reader
    return Reader.read(SimpleNamespace(pieces=pieces, path="the checkpoint"), key, start, n)


def reference_save(root, step: int, model, opt):
    from minidist import checkpoint
    return checkpoint.save(root, step, model, [opt], keep=0)  # keep=0: delete no older one


def reference_load(path, model, opt) -> int:
    from minidist import checkpoint
    return checkpoint.load(path, model, [opt])["step"]


# Tiered hints, shown one at a time by `python -m exercises.grade 08 --hint` (moved out of the stub, which poses the problem).
_PIECES = (
    "pieces_of: lay the unit's parameters out as the buffer does (sorted by group, a stable "
    "sort), each over [offset, offset + numel) of the flat buffer; rank r's window is "
    "[r*S, (r+1)*S). A piece is the intersection of the window with one parameter's range, "
    "when it is not empty.")
_READ = (
    "read: copy the part of each piece that overlaps [start, start + n) into its place in "
    "the result, and keep track of which elements some piece covered: any left uncovered "
    "means a damaged checkpoint (ValueError naming the key).")
_SAVE_PIECES = (
    "save, the pieces: each unit's layout (layout_of) and pieces_of say which elements of "
    "which parameter this rank holds; each becomes a piece of the weight ('model/' + name) "
    "and one of each AdamW moment ('optim/' + name + '/' + k, from shard_state), plus "
    "AdamW's 0-dim state, this rank's RNG state, the step and the world size, in one file "
    "per rank written with torch.save.")
_CLONE = (
    "clone() each piece: torch.save writes a view's whole storage (the entire unit), not "
    "just the view's elements, so an unclone'd slice writes every element many times.")
_ATOMIC = (
    "save, atomically: the ranks write into a hidden folder (a name starting with '.' is "
    "not a checkpoint) that exists before anyone writes, and the folder gets its real name "
    "by one rename (os.replace), the last thing written, once every rank's file is on disk. "
    "A rename is atomic: a kill at any moment leaves the new checkpoint whole or invisible, "
    "and the previous ones untouched.")
_LOAD = (
    "load: read every file of the folder and index their pieces by key; read() puts any "
    "range back together from them, whoever wrote them. The weights are replicated: every "
    "rank reads every parameter whole. The moments are sharded: for each unit, this rank's "
    "pieces (pieces_of, for the world size load runs on) read back into flat moments laid "
    "out like its shard, then set_shard_state with the saved 0-dim state: AdamW's step "
    "counter must come back too (its bias correction depends on it).")
_RNG = (
    "load, the RNG: when the checkpoint was saved by as many ranks as load runs on, rank r "
    "restores rank r's saved state (torch.set_rng_state), so that dropout draws the masks "
    "the uninterrupted run would have; on another number of ranks leave it alone.")

# the last tier of each: where the usual mistakes are (the answer itself is yours)
_PITFALLS_PIECES = (
    "Check your offsets on paper with the grader's cases: a parameter longer than a shard "
    "spans three ranks, a rank may hold only padding (no piece at all), and `start` counts "
    "from the parameter's first element while a and b count from the buffer's.")
_PITFALLS_READ = (
    "The pieces come in any order and may start before `start` or end after start + n: "
    "take only each piece's overlap with the range. A key with no piece at all is a "
    "KeyError; a range with any element in no piece is a ValueError.")
_PITFALLS_SAVE = (
    "Three things go wrong most: a folder made visible before every rank has written "
    "(rename it into place last, once all files are on disk: barriers), a killed save's "
    "hidden folder left in the way of the next save (empty it before creating it), and "
    "views saved without clone() (torch.save writes the whole storage).")
_PITFALLS_LOAD = (
    "Every rank reads every weight whole (they are replicated), but only its own shard of "
    "the moments; the step counter is AdamW's 0-dim state and must come back too; the RNG "
    "state comes back only on the same number of ranks, each rank its own.")

HINTS = {
    "_pieces_one_group": [_PIECES, _PITFALLS_PIECES],
    "_pieces_padded": [_PIECES, _PITFALLS_PIECES],
    "_read_assembles": [_READ, _PITFALLS_READ],
    "_read_gaps": [_READ, _PITFALLS_READ],
    "_atomic": [_ATOMIC, _PITFALLS_SAVE],
    "_bytes": [_SAVE_PIECES, _CLONE, _PITFALLS_SAVE],
    "_loaded": [_SAVE_PIECES, _LOAD, _PITFALLS_LOAD],
    "_continues": [_LOAD, _PITFALLS_LOAD],
    "_same_world": [_RNG, _PITFALLS_LOAD],
}
