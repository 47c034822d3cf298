"""Checkpoints: save and resume, sharded, independent of the world size. Chapter 08
(chapters/08_at_scale.md). Exercised by:

    torchrun --standalone --nproc_per_node=4 minidist/train_gpt.py --zero-stage 2 --checkpoint-every 50
    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --zero-stage 3 --resume auto

Each rank writes only what it holds; no rank gathers the whole model. A piece is "elements
[start, start + n) of the flattened full-model tensor KEY", so a run on M ranks copies
what it now holds from whichever pieces overlap, whatever N, ZeRO stage and --tp wrote
them (minidist/checkpoint/slots.py). Atomic: ranks write into a hidden folder that rank 0
renames into place after a barrier. Only finite states are saved (NonFiniteCheckpointError).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from minidist.checkpoint.io import (FORMAT, JUNK, MARKER, CheckpointError, Reader, atomic_write, check_step,
                                    fsync, prune, shard_checksums, shard_name, why_failed, write_meta,
                                    written_by_minidist)
from minidist.checkpoint.slots import Layout, PieceIndex
from minidist.dist import barrier_or_failure, rank_and_world
from minidist.checkpoint.faults import inject_fault

# ---- saving ------------------------------------------------------------------------

class SaveError(RuntimeError):
    """save() failed on some rank (a full disk, a read-only folder, a folder in the way),
    and every rank knows it: the message names the rank, the error and what to change. Its
    temporary folder is gone; the previous checkpoints are untouched."""


def _write_shard(path: Path, shard: dict) -> None:
    """torch.save(shard) to `path`, atomically. A write that fails raises its own OSError:
    torch reports one as a RuntimeError ("unexpected pos ..."), hiding a full disk."""
    def write(tmp):
        errors = []
        with open(tmp, "wb") as f:
            def keep(b):
                try:
                    return f.write(b)
                except OSError as e:
                    errors.append(e)
                    raise
            try:
                torch.save(shard, SimpleNamespace(write=keep, flush=f.flush))
            except RuntimeError:
                if not errors:
                    raise
                raise errors[0] from None
    atomic_write(path, write)


def _failed(final: Path, tmp: Path, rank: int, failed: str, mine: bool) -> SaveError:
    """Every rank heard of the failure: rank 0 removes the temporary folder (all ranks are
    past writing into it), so a full disk is not kept full."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return SaveError(f"checkpoint {final} was not saved ({failed}); the previous ones are "
                     "untouched" + ("" if mine else "; that rank's error says why"))


class NonFiniteCheckpointError(FloatingPointError):
    """save() refused: some weight, optimizer state or the loss scale is inf or NaN (the run
    has diverged). Nothing was written or deleted. `step`: the step it was asked to save;
    `what`: the groups that were not finite ("model", "optimizer 0", "loss scale")."""

    def __init__(self, message: str, step: int, what: list[str]):
        super().__init__(message)
        self.step, self.what = step, what


def _finite(tensors: list) -> torch.Tensor:
    """Whether every element of every tensor is finite (a bool tensor): one fused pass per
    device over the group, the largest |x| of each tensor (inf and NaN stay so)."""
    ts, out = [t for t in tensors if t.is_floating_point() and t.numel()], torch.tensor(True)
    for device in {t.device for t in ts}:
        largest = torch._foreach_norm([t for t in ts if t.device == device], math.inf)
        out &= torch.isfinite(torch.stack([n.float() for n in largest])).all().cpu()
    return out


def _comm_device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only


def _agree(rank: int, world: int, finite: list[torch.Tensor]) -> tuple[str, list[bool]]:
    """One all-reduce (MAX): rank 0's random id for this checkpoint (the others give 0) and
    whether any rank found a group not finite. Returns (id as 32 hex digits, flags)."""
    ids = [int.from_bytes(os.urandom(8), "big") >> 1 for _ in range(2)] if rank == 0 else [0, 0]
    flags = torch.tensor(ids + [0] * len(finite), dtype=torch.int64)
    flags[2:] = (~torch.stack(finite)).long()
    if world > 1:
        flags = flags.to(_comm_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        flags = flags.cpu()
    hi, lo, *bad = flags.tolist()
    return f"{hi:016x}{lo:016x}", [bool(b) for b in bad]


def save(root, step: int, model, optimizers, scaler=None, extra: dict | None = None,
         keep: int = 2) -> Path:
    """Write `root`/step_<step>/ (a collective: every rank calls it); keep the newest `keep`
    (0: delete none). Raises NonFiniteCheckpointError, on every rank and before anything is
    written, if a weight, an optimizer state or the loss scale is inf or NaN; SaveError, on
    every rank, if a write fails on any."""
    rank, world, root = *rank_and_world(), Path(root)
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    # what this rank writes, still where it lives (GPU or CPU): (key, full shape, runs, tensor)
    layout = Layout(model)  # (a collective when the model is tensor-parallel: who holds what)
    pieces = [(s.key, s.shape, s.runs, s.tensor.detach()) for s in layout.slots(model, optimizers) if s.write]
    scalars = {}
    for i, opt in enumerate(optimizers):
        for name, shape, runs, holder, cut, write in layout.holders(opt):
            for k, v in opt.state.get(holder, {}).items():
                key = f"optim{i}/{name}/{k}"
                if not (torch.is_tensor(v) and v.dim() > 0):
                    scalars[key] = v.detach() if torch.is_tensor(v) else v
                elif write:
                    flat = v.detach().view(-1)
                    pieces.append((key, shape, runs, flat if cut is None else flat[cut[0]:cut[1]]))
    scaler_state = scaler.state_dict() if scaler is not None else {}
    groups = {"model": [], **{f"optimizer {i}": [] for i in range(len(optimizers))},
              "loss scale": [torch.tensor([float(scaler_state.get("scale", 1.0))])]}
    numbers = [(k, torch.as_tensor(v).reshape(-1)) for k, v in [(k, t) for k, *_, t in pieces]
               + list(scalars.items()) if torch.is_tensor(v) or type(v) is float]
    for key, v in numbers:  # "optim3/..." is optimizer 3's
        groups["model" if key.startswith("model/") else f"optimizer {key[5:key.index('/')]}"].append(v)
    # nothing non-finite is ever saved: found before any file changes, the same on every rank
    ckpt_id, bad = _agree(rank, world, [_finite(ts) for ts in groups.values()])
    if any(bad):
        what = [g for g, b in zip(groups, bad) if b]
        mine = [k for k, v in numbers if not bool(torch.isfinite(v).all())]  # (the slow way, now)
        raise NonFiniteCheckpointError(
            f"checkpoint {final} was not saved: {', '.join(what)} not finite (inf or NaN)"
            + (f", e.g. {', '.join(mine[:3])} on rank {rank}" if mine else "")
            + ": the run has diverged; the previous checkpoints are untouched", step, what)
    error = None
    if rank == 0:
        try:
            for junk in root.glob(".*_step_*") if root.is_dir() else []:
                if JUNK.fullmatch(junk.name):
                    shutil.rmtree(junk, ignore_errors=True)
            if final.exists() and not written_by_minidist(final):
                error = (f"{final} exists and is not a checkpoint minidist wrote: move it "
                         "away, or choose another folder")
            else:
                tmp.mkdir(parents=True)
        except OSError as e:  # every rank must hear of it, not wait at the barrier
            error = f"rank 0 could not create {tmp}: {why_failed(e, root)}"
    failed = barrier_or_failure(error)
    if failed:
        raise _failed(final, tmp, rank, failed, True)
    rng = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()}
                                            if torch.cuda.is_initialized() else {})}
    # clone: only these bytes (torch.save writes a view's whole storage); each run a piece,
    # a view of its slot's one copy (a shard's rows: one storage in the file, not one each)
    shard = {"pieces": [(k, shape, s, copy[o:o + n]) for k, shape, runs, t in pieces
                        for copy in [t.cpu().clone()] for o, s, n in runs],
             "scalars": {k: v.cpu().clone() if torch.is_tensor(v) else v for k, v in scalars.items()},
             "rng": rng, "rank": rank,
             "identity": {"id": ckpt_id, "step": step, "rank": rank, "world_size": world}}
    shard["checksums"] = shard_checksums(shard)  # verified at every load; the seal binds it here
    try:
        _write_shard(tmp / shard_name(rank, world), shard)
    except OSError as e:  # a full disk, a lost mount, no shared folder: all must hear of it
        error = f"rank {rank}: {why_failed(e, root)}"
    except Exception as e:
        error = f"rank {rank}: {type(e).__name__}: {e}"
    inject_fault("save", step, rank)
    failed = barrier_or_failure(error)  # every shard is on disk, or every rank knows one is not
    if failed:
        raise _failed(final, tmp, rank, failed, bool(error))
    if rank == 0:
        try:
            meta = {"kind": MARKER, "format": FORMAT, "id": ckpt_id, "step": step, "world_size": world,
                    "optimizers": [{"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                     for g in o.param_groups]} for o in optimizers],
                    "scaler": scaler_state, "extra": extra or {}}
            write_meta(tmp / "meta.json", meta)  # strict JSON, with its own checksum
            if final.exists():  # saving the same step again: move the old one out of the way
                old = root / f".old_step_{step:08d}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                shutil.rmtree(old)
            os.replace(tmp, final)  # the moment the checkpoint exists, whole
            fsync(root)  # the rename itself survives a power cut, not only a killed process
            prune(root, keep, final)
        except OSError as e:
            error = f"rank 0: {why_failed(e, root)}"
        except Exception as e:  # (a meta.json that would not read back: CheckpointError)
            error = f"rank 0: {type(e).__name__}: {e}"
    failed = barrier_or_failure(error)
    if failed:
        raise _failed(final, tmp, rank, failed, bool(error))
    return final


# ---- loading ------------------------------------------------------------------------

# the loss scaler's settings: the resuming run's own (flags documented as changeable on
# resume); the rest of its state (the scale, its counters) comes from the checkpoint
SCALER_SETTINGS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale")


def _scaler_state(saved: dict, now: dict) -> dict:
    state = {**saved, **{k: now[k] for k in SCALER_SETTINGS if k in now}}
    if "growth_tracker" in state and "growth_interval" in state:  # a shorter interval: grow next time
        state["growth_tracker"] = min(state["growth_tracker"], state["growth_interval"] - 1)
    return state


def load(path, model, optimizers, scaler=None, total_steps: int | None = None) -> dict:
    """Fill `model`, `optimizers` (same kinds, same order) and `scaler` from checkpoint
    `path`, saved on any world size at any ZeRO stage; every mismatch is found before
    anything changes (CheckpointError; CheckpointPastEndError past `total_steps`). The
    scaler takes the saved scale and counters. Returns the meta; meta["rng_restored"]: the
    world size is unchanged, so each rank got its RNG state back."""
    rank, world = rank_and_world()
    r = Reader(path)
    if total_steps is not None:
        check_step(r.meta, total_steps)
    layout = Layout(model)  # (a collective when the model is tensor-parallel)
    fills, problems = [], []  # (destination 1-D tensor, key, runs), checked first
    for s in layout.slots(model, optimizers):
        if s.key not in r.shapes:
            problems.append(f"{s.key} is not in the checkpoint")
        elif r.shapes[s.key] != s.shape:
            problems.append(f"{s.key}: {r.shapes[s.key]} in the checkpoint, {s.shape} here")
        else:
            fills.append((s.tensor, s.key, s.runs))
    wanted = {f"model/{n}" for n in layout.all_names}  # (a pipeline stage: what any stage holds)
    problems += [f"{k} is in the checkpoint but not in this model"
                 for k in r.shapes if k.startswith("model/") and k not in wanted]
    if len(r.meta["optimizers"]) != len(optimizers):
        problems.append(f"{len(r.meta['optimizers'])} optimizers saved, {len(optimizers)} here")
    problems += [f"optimizer {i}: {len(saved['param_groups'])} param groups saved, {len(o.param_groups)} here"
                 for i, (o, saved) in enumerate(zip(optimizers, r.meta["optimizers"]))
                 if len(saved["param_groups"]) != len(o.param_groups)]
    states = []  # (optimizer, holder, state key, value or (key, runs, cut))
    for i, opt in enumerate(optimizers):
        for name, shape, runs, holder, cut, _ in layout.holders(opt):
            prefix = f"optim{i}/{name}/"
            for key in [k for k in r.shapes if k.startswith(prefix)]:
                states.append((opt, holder, key[len(prefix):], (key, runs, cut)))
            for key in [k for k in r.scalars if k.startswith(prefix)]:
                states.append((opt, holder, key[len(prefix):], r.scalars[key]))
    if problems:
        saved = r.meta["extra"].get("config")
        raise ValueError(f"checkpoint {path} does not fit this model/optimizer:\n  "
                         + "\n  ".join(problems[:10]) + (f"\n  (saved model config: {saved})" if saved else "")
                         + "\nresume with the same model and optimizer flags as the run that saved it")
    # the bytes this rank is about to read match their checksums, before anything changes
    r.verify({key for _, key, _ in fills} | {v[0] for *_, v in states if isinstance(v, tuple)})
    index = PieceIndex(r)
    with torch.no_grad():
        for dest, key, runs in fills:
            index.fill(dest, key, runs)
        for opt, holder, k, value in states:
            st = opt.state[holder]  # (ZeRO's .state is its inner optimizer's)
            if isinstance(value, tuple):  # elementwise: fill this holder's range of it
                key, runs, cut = value
                if k not in st:
                    st[k] = torch.zeros_like(holder)
                index.fill(st[k].view(-1) if cut is None else st[k].view(-1)[cut[0]:cut[1]], key, runs)
            else:
                st[k] = value.clone() if torch.is_tensor(value) else value
        for opt, saved in zip(optimizers, r.meta["optimizers"]):
            for g, sg in zip(opt.param_groups, saved["param_groups"]):
                g.update({k: tuple(v) if isinstance(v, list) else v for k, v in sg.items()})
    if scaler is not None and scaler.enabled and r.meta["scaler"]:
        scaler.load_state_dict(_scaler_state(r.meta["scaler"], scaler.state_dict()))
    meta = dict(r.meta)
    meta["rng_restored"] = r.meta["world_size"] == world and rank in r.rng
    if meta["rng_restored"]:
        torch.set_rng_state(r.rng[rank]["cpu"])
        if "cuda" in r.rng[rank] and torch.cuda.is_available():
            torch.cuda.set_rng_state(r.rng[rank]["cuda"])
    return meta

