"""Exercise 08's grader catches the classic mistakes of a sharded checkpoint, each in the
checks it belongs to, and a solution written the way the exercise asks scores full.

(tests/test_exercises.py proves that the stubs score 0 and minidist scores full.)
pieces_of and read are graded in this process, so their mistakes cost nothing to run.
save and load need processes: ONE launch per world size (4, 2, 3 and 1 ranks, as the
grader's) runs every part of the grader for the plain solution and for every mistake of
save and load, each in its own folder; each is then graded from its share of the
results. The mistakes are the plain solution with one piece changed. The functions live
at module level: cloudpickle ships them to the ranks by name.
"""

import functools
import importlib
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from exercises import checks_08 as C8
from exercises import grade as G
from grading_helpers import assert_keys_name_each_check_once, failed_checks, message_of

E8 = importlib.import_module("exercises.08_at_scale")  # its name starts with a digit


# -- 0. a plain solution, written the way the exercise asks (its helpers, its hints)

def plain_pieces_of(layout, rank, world, mistake=None):
    order = layout if mistake == "bucket order" else sorted(layout, key=lambda e: e[2])
    total = sum(numel for _, numel, _ in order)
    chunk = total // world if mistake == "no padding" else -(-total // world)
    lo, hi = rank * chunk, (rank + 1) * chunk
    if mistake == "end included":
        hi += 1  # [lo, hi] read as inclusive: the next rank's first element too
    out, offset = [], 0
    for name, numel, _ in order:
        a, b = max(lo, offset), min(hi, offset + numel)
        if a < b:
            out.append((name, a if mistake == "start in the unit" else a - offset, a, b))
        offset += numel
    return out


def plain_read(pieces, key, start, n, mistake=None):
    chunks = pieces[key]
    out = torch.zeros(n, dtype=chunks[0][1].dtype)
    have = torch.zeros(n, dtype=torch.bool)
    for s, t in chunks:
        a, b = max(start, s), min(start + n, s + t.numel())
        if a < b:
            # "piece offset forgotten": t indexed as if every piece began at element 0
            out[a - start:b - start] = t[a:b] if mistake == "piece offset forgotten" else t[a - s:b - s]
            have[a - start:b - start] = True
    if not have.all() and mistake != "no gap check":
        raise ValueError(f"{key}: element {start + int((~have).nonzero()[0])} is in no piece")
    return out


def plain_save(root, step, model, opt, mistake=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(root)
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    if mistake == "in place":  # written where it will be read, no rename
        tmp = final
    if rank == 0:
        if mistake not in ("leftover kept", "in place"):
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=mistake == "in place")
    dist.barrier()
    names = E8.param_names(model)
    pieces, scalars = [], {}
    for u in opt.units:
        flats, sc = E8.shard_state(opt, u)
        scalars.update(sc)
        for name, start, a, b in plain_pieces_of(E8.layout_of(u, names), rank, world):
            if mistake not in ("every rank writes every weight", "rank 0 writes every weight"):
                w = u.flat[a:b] if mistake == "slices not cloned" else u.flat[a:b].clone()
                pieces.append((f"model/{name}", start, w))
            for k, flat in flats.items():
                pieces.append((f"optim/{name}/{k}", start, flat[a - u.lo:b - u.lo].clone()))
    if mistake == "every rank writes every weight":  # replicated, so written N times
        pieces += [(f"model/{names[id(p)]}", 0, p.detach().reshape(-1).clone()) for p in model.parameters()]
    if mistake == "rank 0 writes every weight" and rank == 0:  # each once, but all by one rank
        pieces += [(f"model/{name}", 0, p.detach().reshape(-1).clone())
                   for name, p in model.named_parameters()]
    torch.save({"pieces": pieces, "scalars": scalars, "rng": torch.get_rng_state(), "step": step,
                "world": world, "rank": rank}, tmp / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0 and tmp != final:
        os.replace(tmp, final)
    dist.barrier()
    return final


def plain_load(path, model, opt, mistake=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    files = [torch.load(f, weights_only=True) for f in sorted(Path(path).glob("rank_*.pt"))]
    pieces = {}
    for f in files:
        for key, start, t in f["pieces"]:
            pieces.setdefault(key, []).append((start, t))
    scalars = files[0]["scalars"]
    if mistake == "AdamW step restarted":
        scalars = {k: torch.zeros_like(v) for k, v in scalars.items()}
    names = E8.param_names(model)
    moments = sorted({key.rsplit("/", 1)[1] for key in pieces if key.startswith("optim/")})
    with torch.no_grad():
        for u in opt.units:
            flats = {k: torch.zeros_like(u.shard) for k in moments}
            for name, start, a, b in plain_pieces_of(E8.layout_of(u, names), rank, world):
                if mistake == "own shard of the weights only":
                    u.flat[a:b] = plain_read(pieces, f"model/{name}", start, b - a)
                for k in moments:
                    flats[k][a - u.lo:b - u.lo] = plain_read(pieces, f"optim/{name}/{k}", start, b - a)
            E8.set_shard_state(opt, u, flats, scalars)
        if mistake != "own shard of the weights only":
            for name, p in model.named_parameters():
                p.view(-1).copy_(plain_read(pieces, f"model/{name}", 0, p.numel()))
    by_rank = {f["rank"]: f for f in files}
    if files[0]["world"] == world and mistake != "RNG not restored":
        torch.set_rng_state(by_rank[0 if mistake == "rank 0's RNG on every rank" else rank]["rng"])
    return files[0]["step"] + (1 if mistake == "returns the next step" else 0)


# The checks of exercise 08, by a word of their names.
CHECK8 = {"one group": "pieces_of, one param group", "padded": "pieces_of, padding",
          "assembles": "read: a range", "gaps": "read: ValueError", "atomic": "save is atomic",
          "bytes": "each element once", "loaded": "load on 2, 3 and 1 ranks",
          "continues": "training continues", "same": "on the same 4 ranks"}
IN_PROCESS = {"one group", "padded", "assembles", "gaps"}

# name: (function it changes, {check that must fail: a phrase its message contains})
PIECE_MISTAKES = {
    "end included": ("pieces_of", {"one group": "the end is excluded", "padded": "the end is excluded"}),
    "no padding": ("pieces_of", {"padded": "padded to S * N"}),
    "bucket order": ("pieces_of", {"padded": "sorted by param group"}),
    "start in the unit": ("pieces_of", {"one group": "within the parameter",
                                        "padded": "within the parameter"}),
    # its slices come out too short: it crashes where the gaps check wants ValueError too
    "piece offset forgotten": ("read", {"assembles": "t[a - s:b - s]", "gaps": "raise ValueError"}),
    "no gap check": ("read", {"gaps": "raise ValueError"}),
}
RANK_MISTAKES = {
    "in place": ("save", {"atomic": "not whole"}),
    "leftover kept": ("save", {"atomic": "saving step 2 again failed"}),
    "every rank writes every weight": ("save", {"bytes": "every rank wrote every weight"}),
    "slices not cloned": ("save", {"bytes": "clone()"}),
    "rank 0 writes every weight": ("save", {"bytes": "every rank writes only what it holds"}),
    "AdamW step restarted": ("load", {"loaded": "step counter", "continues": "one process",
                                      "same": "step counter"}),
    "RNG not restored": ("load", {"same": "RNG state"}),
    "rank 0's RNG on every rank": ("load", {"same": "RNG state"}),
    "returns the next step": ("load", {"loaded": "want 2", "continues": "one process",
                                       "same": "want 2"}),
    "own shard of the weights only": ("load", {"loaded": "replicated", "continues": "one process",
                                               "same": "to the bit"}),
}


def _fns(label):
    """The four functions of solution `label`: the plain ones, one of them with its mistake."""
    fns = dict(pieces_of=plain_pieces_of, read=plain_read, save=plain_save, load=plain_load)
    mistakes = {**PIECE_MISTAKES, **RANK_MISTAKES}
    if label in mistakes:
        which = mistakes[label][0]
        fns[which] = functools.partial(fns[which], mistake=label)
    return fns


SOLUTIONS = ["plain", *RANK_MISTAKES]


def _on_ranks(label, part, root, fns, r, n):
    return C8.PARTS[part](os.path.join(root, label.replace(" ", "_").replace("'", "")), _fns(label), r, n)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Every part, for the plain solution and every mistake of save and load, in one
    launch per world size."""
    root = str(tmp_path_factory.mktemp("ex08"))
    parts, plan = {"oracle": functools.partial(C8.PARTS["oracle"], root)}, {}
    for n, names in C8.PLAN.items():
        plan[n] = ["oracle"] if "oracle" in names else []
        for label in SOLUTIONS:
            for p in names:
                if p != "oracle":
                    parts[f"{label}|{p}"] = functools.partial(_on_ranks, label, p, root)
                    plan[n].append(f"{label}|{p}")
    return C8.H.run_all(parts, {}, plan, C8.TIMEOUT_S, C8.HANG_HINT)


def _grade(label, shared, monkeypatch):
    mine = {(p, n): shared[p if p == "oracle" else f"{label}|{p}", n]
            for n, names in C8.PLAN.items() for p in names}
    monkeypatch.setattr(C8, "_results", lambda impl: mine)
    return G.grade("08", overrides=_fns(label))


def _failed(result):
    return failed_checks(result, CHECK8)


def _message(messages, key):
    return message_of(messages, CHECK8, key)


def test_08_check_keys_name_each_check_once():
    assert_keys_name_each_check_once("08", CHECK8)


def test_08_a_plain_solution_scores_full(shared, monkeypatch):
    r = _grade("plain", shared, monkeypatch)
    assert r.points == r.max_points, {c.name: c.message for c in r.checks if not c.ok}


@pytest.mark.parametrize("mistake", list(RANK_MISTAKES))
def test_08_save_load_mistake_loses_the_points_of_its_checks(mistake, shared, monkeypatch):
    _, must_fail = RANK_MISTAKES[mistake]
    r = _grade(mistake, shared, monkeypatch)
    which, messages = _failed(r)
    assert which == set(must_fail), messages
    assert 0 < r.points < r.max_points
    for key, phrase in must_fail.items():
        msg = _message(messages, key)
        assert phrase in msg and "not implemented" not in msg, (key, msg)


@pytest.mark.parametrize("mistake", list(PIECE_MISTAKES))
def test_08_pieces_and_read_mistakes_lose_the_points_of_their_checks(mistake, monkeypatch):
    # the in-process checks only (the processes' checks: the plain save and load, above)
    monkeypatch.setitem(G.CHECKS, "08", [c for c in G.checks_of("08")
                                         if any(CHECK8[k] in c.name for k in IN_PROCESS)])
    _, must_fail = PIECE_MISTAKES[mistake]
    r = G.grade("08", overrides=_fns(mistake))
    which, messages = _failed(r)
    assert which == set(must_fail), messages
    assert r.points < r.max_points and (r.points > 0 or r.total == len(must_fail))
    for key, phrase in must_fail.items():
        msg = _message(messages, key)
        assert phrase in msg and "not implemented" not in msg, (key, msg)


def test_08_the_stub_is_graded_without_starting_processes(monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a stub needs no launch")
    monkeypatch.setattr(C8.H, "run_all", no_launch)
    r = G.grade("08")
    assert r.points == 0 and all(c.message.startswith("not implemented: ") for c in r.checks)


# -- the grader's oracles

def test_08_the_layout_built_by_hand_is_minidists():
    # pieces_of's oracle lays the unit out itself: it must be minidist.zero.Unit's
    # layout (sorted by group, padded, cut in N), built from parameters holding its codes
    from minidist.zero import Unit
    for layout, worlds in C8.ONE_GROUP + C8.PADDED_GROUPED:
        for n in worlds:
            flat, chunk = C8._by_hand(layout, n)
            for r in range(n):
                params = [torch.nn.Parameter(C8.CODE * (k + 1) + torch.arange(numel, dtype=torch.float64))
                          for k, (_, numel, _) in enumerate(layout)]
                u = Unit(params, {p: g for p, (_, _, g) in zip(params, layout)}, r, n)
                assert torch.equal(u.flat, flat) and u.chunk == chunk and u.lo == r * chunk, (layout, n, r)
    # and the layouts have what the checks say: padding, a rank with only padding, groups
    # out of order, a parameter longer than a shard
    padded = [(lay, n) for lay, ns in C8.PADDED_GROUPED for n in ns]
    assert all(sum(k for _, k, _ in lay) % n == 0 for lay, ns in C8.ONE_GROUP for n in ns)
    assert any(C8._by_hand(lay, n)[0][-C8._by_hand(lay, n)[1]:].eq(0).all() for lay, n in padded)
    assert all(not torch.equal(C8._by_hand(lay, n)[0], C8._by_hand(lay, n, grouped=False)[0])
               for lay, _ in C8.PADDED_GROUPED for n in (2,))
    assert any(max(k for _, k, _ in lay) > 2 * C8._by_hand(lay, n)[1]
               for lay, ns in C8.ONE_GROUP for n in ns)


def test_08_the_grader_model_has_units_that_pad_and_mix_groups():
    # the checkpoint runs must exercise padding (at 3 and 4 ranks) and group order
    from unittest import mock
    for n in (3, 4):
        with mock.patch.object(dist, "get_rank", lambda group=None: 0), \
                mock.patch.object(dist, "get_world_size", lambda group=None: n):
            model, opt = C8._setup(0.0, 2)
        sizes = [sum(p.numel() for p in u.params) for u in opt.units]
        assert len(sizes) > 3 and any(s % n for s in sizes), sizes
        order = {id(p): i for i, p in enumerate(model.parameters())}
        # a unit whose layout (sorted by group) is not its bucket order (the model's, reversed)
        assert any([order[id(p)] for p in u.params] != sorted((order[id(p)] for p in u.params), reverse=True)
                   for u in opt.units)


def test_08_torch_distributed_checkpoint_trips_the_rule(tmp_path):
    # the grader runs every part under RULES: a save through torch's own sharded format
    # raises there, naming the API and the rule, and the part scores 0
    import torch.distributed.checkpoint as dcp

    from exercises import _rules
    with _rules.watch(C8.RULES) as w:
        with pytest.raises(_rules.RuleBroken, match="writes its own sharded checkpoint"):
            dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path))
    assert w.broken and "torch.distributed.checkpoint.save" in w.broken[0]
    assert not list(tmp_path.iterdir())  # nothing written
