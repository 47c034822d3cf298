"""Checkpoints: save and resume, sharded, independent of the world size. Chapter 08
(chapters/08_at_scale.md). Exercised by:

    torchrun --standalone --nproc_per_node=4 minidist/train_gpt.py --zero-stage 2 --checkpoint-every 50
    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --zero-stage 3 --resume auto
    python -m minidist.checkpoint out/checkpoints      # intact or damaged, what each holds

A checkpoint is a folder, out/checkpoints/step_00000100/: one file per rank that saved it,
and a meta.json. Each rank writes only what it holds and nobody else does: its ZeRO shard
of the optimizer state (at stage 3, of the parameters too), the momentum of the matrices
it owns under Muon, its share of what is replicated (parameter i: rank i mod N). No rank
gathers the whole model, which at scale would not fit.

What makes it independent of the world size is how a piece is named: not "rank 3's
shard" but "elements [start, start + n) of the flattened tensor KEY", where KEY is a
parameter's name ("model/blocks.0.attn.c_attn.weight") or one of its optimizer state's
("optim0/blocks.0.attn.c_attn.weight/exp_avg"). Resuming on M ranks, each rank works out
which elements of which keys it now holds, and copies them from whichever pieces overlap
them, whatever N and whichever ZeRO stage wrote them. The files are memory-mapped, so a
rank reads only the bytes it needs.

Atomic: the ranks write into a hidden folder; once all have (a barrier), rank 0 writes
meta.json and renames the folder into place. A rename is atomic, so a kill at any moment
leaves the new checkpoint whole or no trace of it. Several nodes need a shared folder.

Exact resume also needs the step (the data and the learning-rate schedule are functions
of it), the loss scaler, each rank's RNG state, and the caller's `extra` (train_gpt: its
settings and its log rows). Checksums of every piece and of meta.json, the files' format
and reading them: minidist/checkpoint_io.py.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import torch

from minidist.checkpoint_io import (CheckpointError, Reader, atomic_write, fsync, latest,  # noqa: F401
                                    list_checkpoints, main, read_meta, shard_checksums,
                                    shard_name, verify, write_meta)
from minidist.dist import barrier_or_failure, rank_and_world
from minidist.faults import inject_fault

# ---- what a rank holds: slots -------------------------------------------------------

class Slot(NamedTuple):
    """Elements [start, start + tensor.numel()) of the flattened tensor `key` (full shape
    `shape`) live in `tensor` on this rank. `write`: this rank is the one that saves it."""
    key: str
    shape: tuple
    start: int
    tensor: torch.Tensor
    write: bool = True


def _writers(tensors: list, world: int) -> list[int]:
    """Which rank saves each replicated tensor: largest first, each to the rank with the
    fewest bytes so far, so that the files come out about the same size."""
    load, out = [0] * world, [0] * len(tensors)
    for i in sorted(range(len(tensors)), key=lambda i: (-tensors[i].numel(), i)):
        out[i] = min(range(world), key=lambda r: (load[r], r))
        load[out[i]] += tensors[i].numel() * tensors[i].element_size()
    return out


def _holders(opt, names: dict, rank: int, world: int):
    """(name, shape, start, holder, cut, write) for each range of a parameter's elements
    whose optimizer state lives in `holder` (a key of opt.state) on this rank: the state's
    elements `cut` = (a, b) of the holder (None: all of them). `write`: this rank saves it.

    An optimizer that shards its state (ZeRO, Muon) says what this rank holds through
    opt.state_pieces() -> (state, params), state being (param, start, holder, a, b): the
    param's flattened elements [start, start + b - a) are the holder's [a, b). Every such
    piece is this rank's alone, so it writes them all. Any other optimizer is replicated:
    every rank has all of it, and one rank writes each parameter's state."""
    if hasattr(opt, "state_pieces"):
        for p, start, holder, a, b in opt.state_pieces()[0]:
            yield names[id(p)], tuple(p.shape), start, holder, (a, b), True
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    for p, writer in zip(params, _writers(params, world)):
        yield names[id(p)], tuple(p.shape), 0, p, None, writer == rank


def _model_slots(model, optimizers, names, rank, world) -> list[Slot]:
    """The parameters and persistent buffers: a parameter that an optimizer holds only as
    pieces (ZeRO-3: state_pieces()'s params) is saved piece by piece, by each holder; any
    other is replicated, and one rank writes it."""
    persistent = set(model.state_dict())
    buffers = [(n, b) for n, b in model.named_buffers() if n in persistent]
    slots = [Slot(f"model/{n}", tuple(b.shape), 0, b.view(-1), w == rank)
             for (n, b), w in zip(buffers, _writers([b for _, b in buffers], world))]
    pieces = [piece for o in optimizers if hasattr(o, "state_pieces") for piece in o.state_pieces()[1]]
    slots += [Slot(f"model/{names[id(p)]}", tuple(p.shape), start, t) for p, start, t in pieces
              if t.numel()]  # (an empty piece: sharded, but none of it on this rank)
    in_pieces = {id(p) for p, _, _ in pieces}
    params = [p for p in {id(p): p for p in model.parameters()}.values()  # a tied one once
              if id(p) not in in_pieces]
    return slots + [Slot(f"model/{names[id(p)]}", tuple(p.shape), 0, p.detach().view(-1), w == rank)
                    for p, w in zip(params, _writers(params, world))]


def _names(model) -> dict:
    return {id(p): n for n, p in model.named_parameters()}  # a tied parameter: its first name


# ---- saving ------------------------------------------------------------------------

def _why(e: OSError, where: Path) -> str:
    """What failed, and what to change: a full disk is not a read-only folder."""
    hint = {errno.ENOSPC: f"free space in {where} or choose another folder",
            errno.EDQUOT: f"free space (disk quota) in {where} or choose another folder",
            errno.EACCES: f"{where} is not writable: fix its permissions or choose another folder",
            errno.EPERM: f"{where} is not writable: fix its permissions or choose another folder",
            errno.EROFS: f"{where} is on a read-only file system: choose another folder"}
    return f"{e}; {hint.get(e.errno, f'check that {where} exists and can be written')}"


def save(root, step: int, model, optimizers, scaler=None, extra: dict | None = None,
         keep: int = 2) -> Path:
    """Write `root`/step_<step>/ (a collective: every rank calls it); keep the newest `keep`."""
    rank, world, root = *rank_and_world(), Path(root)
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    error = None
    if rank == 0:
        try:
            for junk in root.glob(".*_step_*"):  # left by a save that was killed
                shutil.rmtree(junk, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:  # every rank must hear of it, not wait at the barrier
            error = f"rank 0 could not create {tmp}: {_why(e, root)}"
    if barrier_or_failure(error):
        raise RuntimeError(f"checkpoint {final} was not saved ({error or 'rank 0 failed'}); "
                           "the previous ones are untouched")
    names = _names(model)
    pieces, scalars = [], {}
    for s in _model_slots(model, optimizers, names, rank, world):
        if s.write:
            pieces.append((s.key, s.shape, s.start, s.tensor.detach().cpu().clone()))
    for i, opt in enumerate(optimizers):
        for name, shape, start, holder, cut, write in _holders(opt, names, rank, world):
            for k, v in opt.state.get(holder, {}).items():
                key = f"optim{i}/{name}/{k}"
                if torch.is_tensor(v) and v.dim() > 0:
                    if not write:
                        continue
                    flat = v.view(-1) if cut is None else v.view(-1)[cut[0]:cut[1]]
                    pieces.append((key, shape, start, flat.detach().cpu().clone()))  # clone: only these bytes
                else:
                    scalars[key] = v.detach().cpu().clone() if torch.is_tensor(v) else v
    rng = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()}
                                            if torch.cuda.is_initialized() else {})}
    shard = {"pieces": pieces, "scalars": scalars, "rng": rng, "rank": rank}
    shard["checksums"] = shard_checksums(shard)  # verified at every load
    try:
        atomic_write(tmp / shard_name(rank, world), lambda f: torch.save(shard, f))
    except OSError as e:  # a full disk, a lost mount, no shared folder: all must hear of it
        error = f"rank {rank}: {_why(e, root)}"
    except Exception as e:
        error = f"rank {rank}: {type(e).__name__}: {e}"
    inject_fault("save", step, rank)
    failed = barrier_or_failure(error)  # every shard is on disk, or every rank knows one is not
    if failed:
        raise RuntimeError(f"checkpoint {final} was not saved ({failed}); the previous ones are "
                           "untouched" + ("" if error else "; that rank's error says why"))
    if rank == 0:
        meta = {"format": 2, "step": step, "world_size": world,
                "optimizers": [{"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                 for g in o.param_groups]} for o in optimizers],
                "scaler": scaler.state_dict() if scaler is not None else {},
                "extra": extra or {}}
        write_meta(tmp / "meta.json", meta)  # strict JSON, with its own checksum
        if final.exists():  # saving the same step again: move the old one out of the way
            old = root / f".old_step_{step:08d}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            shutil.rmtree(old)
        os.replace(tmp, final)  # the moment the checkpoint exists, whole
        fsync(root)  # the rename itself survives a power cut, not only a killed process
        for stale in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(stale, ignore_errors=True)
    barrier_or_failure()
    return final


# ---- loading ------------------------------------------------------------------------

def load(path, model, optimizers, scaler=None) -> dict:
    """Fill `model`, `optimizers` (same kinds, same order) and `scaler` from checkpoint
    `path`, saved on any world size at any ZeRO stage; every mismatch is found before
    anything changes. Returns the meta; meta["rng_restored"]: the world size is unchanged,
    so each rank got its RNG state back (otherwise the caller decides)."""
    rank, world = rank_and_world()
    r = Reader(path)
    names = _names(model)
    fills, problems = [], []  # (destination 1-D tensor, key, start), checked first
    for s in _model_slots(model, optimizers, names, rank, world):
        if s.key not in r.shapes:
            problems.append(f"{s.key} is not in the checkpoint")
        elif r.shapes[s.key] != s.shape:
            problems.append(f"{s.key}: {r.shapes[s.key]} in the checkpoint, {s.shape} here")
        else:
            fills.append((s.tensor, s.key, s.start))
    wanted = {f"model/{n}" for n in [*names.values(), *model.state_dict()]}
    problems += [f"{k} is in the checkpoint but not in this model"
                 for k in r.shapes if k.startswith("model/") and k not in wanted]
    if len(r.meta["optimizers"]) != len(optimizers):
        problems.append(f"{len(r.meta['optimizers'])} optimizers saved, {len(optimizers)} here")
    states = []  # (optimizer, holder, state key, value or (key, start, cut))
    for i, opt in enumerate(optimizers):
        for name, shape, start, holder, cut, _ in _holders(opt, names, rank, world):
            prefix = f"optim{i}/{name}/"
            for key in [k for k in r.shapes if k.startswith(prefix)]:
                states.append((opt, holder, key[len(prefix):], (key, start, cut)))
            for key in [k for k in r.scalars if k.startswith(prefix)]:
                states.append((opt, holder, key[len(prefix):], r.scalars[key]))
    if problems:
        saved = r.meta.get("extra", {}).get("config")
        raise ValueError(f"checkpoint {path} does not fit this model/optimizer:\n  "
                         + "\n  ".join(problems[:10]) + (f"\n  (saved model config: {saved})" if saved else "")
                         + "\nresume with the same model and optimizer flags as the run that saved it")
    # the bytes this rank is about to read match their checksums, before anything changes
    r.verify({key for _, key, _ in fills} | {v[0] for *_, v in states if isinstance(v, tuple)})
    with torch.no_grad():
        for dest, key, start in fills:
            dest.copy_(r.read(key, start, dest.numel()))
        for opt, holder, k, value in states:
            st = opt.state[holder]  # (ZeRO's .state is its inner optimizer's)
            if isinstance(value, tuple):  # elementwise: fill this holder's range of it
                key, start, cut = value
                if k not in st:
                    st[k] = torch.zeros_like(holder)
                dest = st[k].view(-1) if cut is None else st[k].view(-1)[cut[0]:cut[1]]
                dest.copy_(r.read(key, start, dest.numel()))
            else:
                st[k] = value.clone() if torch.is_tensor(value) else value
        for opt, saved in zip(optimizers, r.meta["optimizers"]):
            for g, sg in zip(opt.param_groups, saved["param_groups"]):
                g.update({k: tuple(v) if isinstance(v, list) else v for k, v in sg.items()})
    if scaler is not None and scaler.enabled and r.meta["scaler"]:
        scaler.load_state_dict(r.meta["scaler"])
    meta = dict(r.meta)
    meta["rng_restored"] = r.meta["world_size"] == world and rank in r.rng
    if meta["rng_restored"]:
        torch.set_rng_state(r.rng[rank]["cpu"])
        if "cuda" in r.rng[rank] and torch.cuda.is_available():
            torch.cuda.set_rng_state(r.rng[rank]["cuda"])
    return meta


if __name__ == "__main__":
    main()
