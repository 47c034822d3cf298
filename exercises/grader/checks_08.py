"""Graded checks of exercise 08 (exercises/08_at_scale.py): pieces_of and read here; save and load on the shared
pool (a small GPT saved by 2 ranks, loaded by 2 and 3; on 1 rank, a save killed at each write and rename)."""

import functools
import json
import os
import shutil
import tempfile
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from torch.utils._pytree import tree_leaves

from exercises.grader import Cache, Rules, check, differ, first_problem, per_world_size, run_all
from minidist import checkpoint
from minidist.model import GPT, GPTConfig
from minidist.zero import ShardedOptimizer, Unit

_OWN = "exercise 08 writes its own sharded format, with torch.save and torch.load"
RULES = Rules(forbidden={**{f"torch.distributed.checkpoint:{n}": _OWN for n in
                            ("save", "load", "save_state_dict", "load_state_dict", "async_save")},
                         "minidist.checkpoint:save": _OWN, "minidist.checkpoint:load": _OWN})
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung
HANG_HINT = "save and load are collectives: every rank calls them, the same barriers in the same order."
# 4 units of odd lengths (padded at 2 and 3 ranks), each mixing matrices and vectors: layout != bucket order
CFG = dict(n_layer=2, n_head=1, n_embd=7, block_size=7, vocab_size=53)
CAP_MB, B, S, T = 0.002, 6, 2, 4  # B: 2 and 3 ranks divide it; save at step S, train to T
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4)  # eps: a rounding-noise gradient stays small
RTOL, ATOL = 1e-5, 1e-6  # float32, the gradients averaged over 3 ranks, not 2: in another order
_name = "step_{:08d}".format  # the folder of step s
WORLD, _CACHE = {"save2": 2, "resume3": 3, "kill": 1}, Cache()  # the parts: their world sizes, their results
WATCHED = [(torch, "save"), (Path, "write_text"), (Path, "write_bytes"), (json, "dump"), (os, "replace"),
           (os, "rename")]  # what writes and renames files: a kill lands just before or after each call
LAYOUTS = [  # (layout, world sizes): d spans 3 ranks at 8; at 7 ranks, x and y leave ranks 5 and 6 only padding
    ([("w", 6, 0), ("b", 10, 0), ("c", 4, 0), ("d", 12, 0)], (1, 2, 4, 8)), ([("a", 30, 0)], (3, 5, 6)),
    ([("m1", 7, 0), ("v1", 3, 1), ("m2", 5, 0), ("v2", 2, 1), ("m3", 4, 0)], (2, 3, 4, 5)),  # padded, grouped
    ([("x", 6, 1), ("y", 4, 0)], (3, 4, 7)), ([("g", 5, 2), ("h", 9, 0), ("e", 1, 1), ("k", 8, 0)], (2, 3, 6))]
_READ_HINTS = [
    "Which part of each piece (s, t) overlaps [start, start + n), and where does it go in the result?",
    "For an overlap [a, b), the piece's elements a - s to b - s go to a - start to b - start of the result.",
    "Keep track of what the pieces covered: an element in none means a damaged checkpoint (ValueError)."]


@check("08", 4, name="pieces_of: each rank's pieces are its shard's elements, every element once (N 1 to 8, "
                     "padding, param groups interleaved)", hints=[
    "Where does each parameter sit in the unit's flat buffer, and which elements does rank r hold?",
    "Lay the parameters out as the unit does (sorted by param group, a stable sort), each over [offset, "
    "offset + numel); rank r holds [r*S, (r+1)*S), S = ceil(total / N), the end excluded.",
    "A piece is that window's intersection with one parameter's range, when not empty: a and b count from the "
    "buffer's first element, start from the parameter's."])
def _pieces(impl):  # the oracle: minidist.zero.Unit's own pieces
    for layout, n, r in ((layout, n, r) for layout, worlds in LAYOUTS for n in worlds for r in range(n)):
        got, want = impl.pieces_of([tuple(e) for e in layout], r, n), reference_pieces_of(layout, r, n)
        assert sorted(map(tuple, got)) == sorted(want), (
            f"pieces_of({layout}, rank={r}, world={n}) gave {got}, want {want} (in any order)")


def _read_problem(impl, pieces, key: str, start: int, n: int, want) -> str | None:
    """What read gets wrong of this range: `want` its values, or the exception it must raise."""
    call = f"read(pieces, {key!r}, {start}, {n}), pieces at {sorted(s for s, _ in pieces.get(key, ()))},"
    raises = f"; want {want.__name__}" if isinstance(want, type) else ""
    try:
        got = impl.read(pieces, key, start, n)
    except NotImplementedError:
        raise
    except Exception as e:
        return None if raises and isinstance(e, want) else f"{call} raised {type(e).__name__}: {e}{raises}"
    if raises or not (torch.is_tensor(got) and got.shape == (n,) and got.dtype == want.dtype):
        return f"{call} returned {got!r}" + (raises or f"; want {want.dtype}, shaped ({n},)")
    if len(i := (got != want).nonzero()):
        return f"{call} gave element {start + int(i[0])} = {got[i[0]].item():.6g}, want {want[i[0]].item():.6g}"


def _cut(x: torch.Tensor, cuts, leave_out=()):  # pieces [(start, clone)] of x at the cuts, but `leave_out`'s
    pieces = [(a, x[a:b].clone()) for i, (a, b) in enumerate(zip(cuts, cuts[1:])) if i not in leave_out]
    return pieces[1::2] + pieces[::2]  # out of order


@check("08", 2, name="read: a range put together from the pieces that overlap it", hints=_READ_HINTS)
def _read_assembles(impl):
    g = torch.Generator().manual_seed(8)
    full = {"optim/w/exp_avg": torch.randn(40, generator=g, dtype=torch.float64),
            "model/w": torch.arange(10) * 3 + 1, "model/z": torch.randn(12, generator=g).to(torch.bfloat16)}
    pieces = {"optim/w/exp_avg": _cut(full["optim/w/exp_avg"], [0, 7, 8, 20, 33, 40]),
              "model/w": _cut(full["model/w"], [0, 6, 10]), "model/z": [(0, full["model/z"].clone())]}
    cases = [("optim/w/exp_avg", s, n) for s, n in [(0, 40), (7, 1), (5, 10), (8, 12), (21, 19), (39, 1)]]
    cases += [("optim/w/exp_avg", 12, 3), ("model/w", 4, 5), ("model/w", 0, 10), ("model/z", 3, 6)]
    first_problem(_read_problem(impl, pieces, k, s, n, full[k][s:s + n]) for k, s, n in cases)


@check("08", 1, name="read: ValueError when an element of the range is in no piece", hints=_READ_HINTS)
def _read_gaps(impl):
    pieces = {"g": _cut(x := torch.arange(30.), [0, 2, 12, 15, 27, 30], leave_out={0, 2, 4})}  # [2,12), [15,27)
    cases = [("g", s, n, ValueError) for s, n in [(0, 30), (0, 3), (10, 5), (11, 2), (14, 1), (26, 2), (29, 1)]]
    cases += [("g", s, n, x[s:s + n]) for s, n in [(2, 10), (15, 12), (5, 3), (20, 7)]]
    first_problem(_read_problem(impl, pieces, *case) for case in cases + [("not/there", 0, 1, KeyError)])


def _setup(stage: int, seed: int = 0):  # on a rank: GPT(CFG), seed 0, its ZeRO AdamW; then the RNG at seed
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    torch.manual_seed(seed)
    groups = [{"params": [p for p in model.parameters() if (p.dim() >= 2) == m], "weight_decay": 0.1 * m}
              for m in (True, False)]
    return model, ShardedOptimizer(groups, torch.optim.AdamW, stage=stage, reduce_gradients=True, bucket_cap_mb=CAP_MB,
                                   module=model, **ADAMW)


def _train(model, opt, first, last, r, n):  # steps [first, last): {"final": weights} or {"error": why}
    try:
        for step in range(first, last):
            for g in opt.param_groups:
                g["lr"] = ADAMW["lr"] * (1 - step / (2 * T))  # a function of the step: a wrong step shows
            x = torch.randint(0, CFG["vocab_size"], (B, CFG["block_size"] + 1),
                              generator=torch.Generator().manual_seed(1000 + step))[r * B // n:(r + 1) * B // n]
            model(x[:, :-1], x[:, 1:])[1].backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:
        return {"error": f"training on from step {first!r} raised {type(e).__name__}: {e}"}
    return {"final": {k: p.detach().clone() for k, p in model.named_parameters()}}


def _state(model, opt) -> dict:  # this rank's weights, moments {name/moment: values}, 0-dim state, units' S
    names, moments, scalars = {id(p): k for k, p in model.named_parameters()}, {}, set()
    for view, u, a in opt.shard_views:
        lo, state = u.lo + a, opt.state.get(view, {})
        for p, start, s, e in u.pieces(lo, lo + view.numel()):  # the parameters the view overlaps
            for k, t in state.items():
                if torch.is_tensor(t) and t.dim() > 0:  # NaN where this rank holds none
                    full = moments.setdefault(f"{names[id(p)]}/{k}", torch.full((p.numel(),), float("nan")))
                    full[start:start + e - s] = t.view(-1)[s - lo:e - lo]
        scalars |= {(k, float(t)) for k, t in state.items() if not (torch.is_tensor(t) and t.dim() > 0)}
    return {"params": {k: p.detach().clone() for k, p in model.named_parameters()}, "moments": moments,
            "scalars": sorted(scalars), "chunks": [u.chunk for u in opt.units]}


def _saving(fns, root, step, model, opt):  # save, and the float bytes its torch.save calls wrote
    def counted(obj, *a, **kw):
        floats = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tree_leaves(obj)
                  if torch.is_tensor(t) and t.is_floating_point()}  # each storage once, whole
        seen["bytes"] += sum(floats.values())
        return real(obj, *a, **kw)
    seen, real = {"saved": _state(model, opt), "bytes": 0}, torch.save
    with mock.patch.object(torch, "save", counted):
        fns["save"](str(root), step, model, opt)
    return seen


def _save_part(root, fns, r: int, n: int) -> dict:
    """ZeRO-2: train to S and save; on to T (the uninterrupted run); load that save afresh and train to T."""
    model, opt = _setup(2, seed=100 + r)  # each rank's RNG state its own
    _train(model, opt, 0, S, r, n)
    out, rng = _saving(fns, Path(root) / "r2", S, model, opt), torch.get_rng_state()
    out["want"] = _train(model, opt, S, T, r, n)["final"]
    model, opt = _setup(2, seed=1234 + r)  # a fresh one, its RNG elsewhere, filled by load
    loaded = {"step": fns["load"](str(Path(root) / "r2" / _name(S)), model, opt), "loaded": _state(model, opt),
              "rng": torch.equal(torch.get_rng_state(), rng)}
    return {**out, **loaded, **_train(model, opt, loaded["step"], T, r, n)}


def _resume_part(root, fns, r: int, n: int) -> dict:  # ZeRO-1: load the 2 ranks' checkpoint, train to T, save
    if not (path := Path(root) / "r2" / _name(S)).is_dir():
        return {"skipped": f"there is no {_name(S)} to load"}
    model, opt = _setup(1, seed=1234 + r)  # a fresh one, its RNG elsewhere, filled by load
    out = {"step": fns["load"](str(path), model, opt), "loaded": _state(model, opt)}
    out.update(_train(model, opt, out["step"], T, r, n))
    return {**out, **_saving(fns, Path(root) / "r3", T, model, opt)} if "final" in out else out


def _part(impl, name: str) -> list:  # its per-rank results; the check fails, saying why, if it did not run
    def compute():
        parts = {"save2": _save_part, "resume3": _resume_part, "kill": _kill_part}
        with tempfile.TemporaryDirectory(prefix="minidist-grade-08-") as root:
            return run_all({p: functools.partial(f, root) for p, f in parts.items()}, {"save": impl.save,
                           "load": impl.load}, {n: [p] for p, n in WORLD.items()}, TIMEOUT_S, HANG_HINT)
    if name == "resume3":
        _part(impl, "save2")  # what it loads: why there is none, first
    per_rank = next(per_world_size(_CACHE.get((impl.save, impl.load), compute), name, (WORLD[name],)))[1]
    assert name != "resume3" or "skipped" not in per_rank[-1], per_rank[-1]["skipped"]
    return per_rank


def _difference(got: dict, want: dict, exact: bool = True) -> str | None:  # the first tensor of want's got lacks
    return next(filter(None, (differ(k, got.get(k), w, "what it should be", *((0, 0) if exact else (RTOL, ATOL)))
                              for k, w in want.items())), None)


class Killed(BaseException):
    """The grader's kill inside save: nothing catches it, as nothing catches a SIGKILL."""


@contextmanager
def _kill_points(kill_at: int | None):
    """Yields the points a kill could land at (around each call of WATCHED) as they pass; Killed at kill_at."""
    def passing(where: str) -> None:
        points.append(where)
        if kill_at == len(points) - 1:
            raise Killed(where)
    points = []

    def wrap(owner, attr: str, real):
        def wrapped(*a, **k):
            files = ", ".join("/".join(Path(x).parts[-2:]) for x in a[:2] if isinstance(x, (str, Path)))
            passing(f"just before {owner.__name__}.{attr}({files})")
            out = real(*a, **k)
            passing(f"just after {owner.__name__}.{attr}({files})")
            return out
        return wrapped
    with ExitStack() as stack:
        for owner, attr in WATCHED:
            stack.enter_context(mock.patch.object(owner, attr, wrap(owner, attr, getattr(owner, attr))))
        yield points


def _kill_part(root, fns, r: int, n: int) -> str | None:
    """On 1 rank: a checkpoint of step 1, then a save of step 2 killed at each moment in turn, in a copy of the
    folder: what it leaves, and whether saving again works. (A kill lands between calls: a file written is
    whole, a checkpoint when it holds the files of a save that ran through.)"""
    def files(d: Path) -> dict | None:
        return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} \
            if d.is_dir() else None
    save, root = fns["save"], Path(root)  # save2's and resume3's folders are r2 and r3
    prev, new = _name(1), _name(2)
    model, opt = _setup(2)
    _train(model, opt, 0, 1, 0, 1)
    save(str(root / "t"), 1, model, opt)
    _train(model, opt, 1, 2, 0, 1)
    shutil.copytree(root / "t", root / "root")
    with _kill_points(None) as points:  # the moments of a save that runs through
        save(str(root / "root"), 2, model, opt)
    names = lambda d: files(d) and sorted(files(d))  # noqa: E731
    before, whole = files(root / "t" / prev), names(root / "root" / new)
    if not (before and whole and points):
        return (f"save(root, s, ...) left no root/{prev} (s = 1) or no root/{new} (s = 2)" if points else
                "the grader saw your save call none of " + ", ".join(f"{o.__name__}.{a}" for o, a in WATCHED))
    for i, where in enumerate(points):
        d, said = root / f"k{i}", f"a save of step 2 killed {where}"
        shutil.copytree(root / "t", d)
        with suppress(Killed), _kill_points(i):
            save(str(d), 2, model, opt)
        visible = {e.name for e in d.iterdir() if not e.name.startswith(".")}
        if files(d / prev) != before or visible - {prev, new}:
            return f"{said} changed the previous checkpoint, {prev}, or left {sorted(visible - {prev, new})}"
        if new in visible and names(d / new) != whole:
            return f"{said} left {new} visible, holding {names(d / new)}; whole, it holds {whole}"
        if new not in visible:
            try:
                save(str(d), 2, model, opt)
            except Exception as e:
                return f"after {said}, saving step 2 again raised {type(e).__name__}: {e}"
            if names(d / new) != whole:
                return f"after {said}, saving step 2 again left {new} holding {names(d / new)}, not {whole}"


@check("08", 2, name="save is atomic: killed at any moment it leaves the previous checkpoint untouched "
                     "and the new one whole or invisible",
       hints=["When a kill lands in the middle of save, what is visible in the folder?",
              "Write into a hidden folder that rank 0 emptied and created before a barrier; once every "
              "rank has written (a barrier), rank 0 renames it into place with os.replace, last of all.",
              "A killed save leaves its hidden folder behind: the next save empties it before creating it."])
def _atomic(impl):
    first_problem(_part(impl, "kill"))


@check("08", 2, name="save writes each element once, each by the rank that holds it",
       hints=["Which elements does this rank hold, of the weights and of each moment? Those, and only "
              "those, go in its file.", "torch.save writes a view's whole storage: clone each slice.",
              "4 bytes of weight and 8 of moments per parameter element, over all ranks together."])
def _bytes(impl):
    for name in ("save2", "resume3"):
        per_rank, n = _part(impl, name), WORLD[name]
        params, own = per_rank[0]["saved"]["params"].values(), sum(per_rank[0]["saved"]["chunks"])
        psi, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
        got, most = [x["bytes"] for x in per_rank], 4 * psi + 8 * own * n + 1024 * n
        where = f"on {n} ranks, torch.save wrote {sum(got)} float bytes ({' + '.join(map(str, got))})"
        assert 12 * psi <= sum(got) <= most, (f"{where}; each element once is 12 x {psi} = {12 * psi} (up "
                                              f"to {most} with the moments' padding)")
        for r, b in enumerate(got):
            assert b <= 12 * own + 4 * largest + 1024, (
                f"{where}: rank {r} wrote {b}, more than the {12 * own} of its shards, give or take a tensor")


@check("08", 4, name="load on 2 and 3 ranks puts back exactly what 2 ranks saved (weights, AdamW moments, "
                     "step), and 3 ranks train on as the uninterrupted run (float32 rounding)",
       hints=["After load, what must each rank hold: which weights, which part of the moments, which step?",
              "Every rank reads every weight whole (they are replicated), and for each unit only its own "
              "shard's moments (pieces_of for the world size load runs on), from the pieces of every file.",
              "set_shard_state(opt, u, flats, scalars), with the saved 0-dim state: AdamW's bias correction "
              "reads its step."])
def _loaded(impl):
    def moments(per_rank: list, what: str) -> dict:  # every rank's put together (NaN: on no rank)
        held = [res[what]["moments"] for res in per_rank]
        return {k: functools.reduce(torch.fmax, [m[k] for m in held if k in m]) for k in set().union(*held)}
    src = _part(impl, "save2")
    want_scalars = sorted({v for x in src for v in x["saved"]["scalars"]})
    for name in ("save2", "resume3"):
        per_rank, where = _part(impl, name), f"on {WORLD[name]} ranks, loading what 2 ranks saved at step {S}"
        for r, res in enumerate(per_rank):
            assert res["step"] == S, f"{where}: rank {r}'s load returned {res['step']!r}, want {S}"
            assert (problem := _difference(res["loaded"]["params"], src[0]["saved"]["params"])) is None, (
                f"{where}: after load, rank {r}'s {problem}")
            assert res["loaded"]["scalars"] == want_scalars, (f"{where}: after load, rank {r}'s AdamW holds "
                                                              f"the 0-dim state {res['loaded']['scalars']}, "
                                                              f"saved {want_scalars}")
        problem = _difference(moments(per_rank, "loaded"), moments(src, "saved"))
        assert problem is None, f"{where}: after load, AdamW's {problem} (nan: on no rank)"
    for r, res in enumerate(_part(impl, "resume3")):
        problem = res.get("error") or _difference(res["final"], src[0]["want"], exact=False)
        assert problem is None, (f"on 3 ranks, resumed at step {S}, at step {T} rank {r}'s {problem}, "
                                 f"against the 2 ranks' run uninterrupted (|diff| <= {ATOL} + {RTOL} |want|)")


@check("08", 2, name="resumed on the same 2 ranks: each rank's RNG state back, bit for bit as uninterrupted",
       hints=["What else does the next step read, with dropout on, besides the weights and the optimizer?",
              "Each rank's RNG state: save it, and on the same number of ranks give each rank its own back.",
              "torch.get_rng_state() when saving; torch.set_rng_state() in load when the saved world size is "
              "this one, rank r taking rank r's."])
def _same_world(impl):
    where, per_rank = f"on 2 ranks, saved at step {S}, loaded by a fresh model", _part(impl, "save2")
    bad = [r for r, res in enumerate(per_rank) if not res["rng"]]
    assert not bad, f"{where}: after load, the RNG state of rank(s) {bad} is not the one it had when it saved"
    for r, res in enumerate(per_rank):
        assert (problem := res.get("error") or _difference(res["final"], res["want"])) is None, (
            f"{where}: at step {T}, rank {r}'s {problem}, against the run uninterrupted")


def reference_pieces_of(layout, rank: int, world: int):  # minidist.zero.Unit.pieces, on a unit of this layout
    named = {torch.nn.Parameter(torch.zeros(numel)): (name, g) for name, numel, g in layout}
    u = Unit(list(named), {p: g for p, (_, g) in named.items()}, rank, world)
    return [(named[p][0], start, a, b) for p, start, a, b in u.pieces(u.lo, u.hi)]


def reference_read(pieces: dict, key: str, start: int, n: int):  # minidist.checkpoint.Reader.read, on these
    return checkpoint.Reader.read(SimpleNamespace(pieces=pieces, path="the checkpoint"), key, start, n)


def reference_save(root, step: int, model, opt):  # minidist.checkpoint.save, deleting no older checkpoint
    return checkpoint.save(root, step, model, [opt], keep=0)


def reference_load(path, model, opt) -> int:  # minidist.checkpoint.load; the step it returns
    return checkpoint.load(path, model, [opt])["step"]
