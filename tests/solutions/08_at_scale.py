"""Exercise 08: a sharded checkpoint that resumes on a different number of ranks.

Every rank of a ZeRO-1/2 run writes only what it holds, and any number of ranks can load it,
because a piece is named (key, start, tensor): elements [start, start + numel) of the flattened
tensor `key`, "model/" + a parameter's name or "optim/" + name + "/" + an AdamW moment
(exp_avg, exp_avg_sq). Read chapters/08_at_scale.md, section 2 "Sharded checkpoints, and why
they survive a change of world size" and section 3 "Atomic writes: what a kill leaves"
(section 1, "What an exact resume needs", lists what to save).

The layout is chapter 06's (minidist.zero.Unit): a unit's parameters sorted by param group (a
stable sort), back to back in one flat buffer padded with zeros to a multiple of N; rank r
holds [r*S, (r+1)*S), S = ceil(total / N). A unit u of a ShardedOptimizer `opt` has u.params
(in layout order), u.flat, u.chunk (S), u.lo, u.hi and u.shard = u.flat[u.lo:u.hi];
opt.units lists them, the same units on any N. param_names, layout_of, shard_state and
set_shard_state are written for you below. Write:

  pieces_of(layout, rank, world)  layout: [(name, numel, group)] in bucket order. Return
      [(name, start, a, b)]: each parameter's overlap [a, b) (flat coordinates) with the rank's
      elements, starting at element `start` of the parameter; no padding, no empty piece.
  read(pieces, key, start, n)  elements [start, start + n) of `key`, from pieces
      {key: [(start, tensor)]} in any order; ValueError if an element is in no piece.
  save(root, step, model, opt)  a collective; writes root/step_{step:08d} (returned as a Path):
      every rank only what it holds, with torch.save (each element once over all ranks), and
      AdamW's 0-dim state, its RNG state, the step, the world size; atomically (a folder whose
      name starts with "." is not a checkpoint).
  load(path, model, opt)  a collective: every rank gets every weight whole, its shard of the
      moments and the step counter, and, on the world size that saved, rank r gets rank r's
      RNG state back (on another, the RNG is left alone). Returns the step saved.

Graded (a small GPT, AdamW in two param groups, saved by ZeRO-2 on 2 ranks, loaded on 2 and 3):
  - pieces_of, against minidist's units (N 1 to 8, padding, straddling, param groups interleaved)
  - read puts a range together from pieces in any order, and refuses one with a gap (ValueError)
  - save, killed before or after any write or rename: the old checkpoint intact, the new whole or absent
  - save writes each element once (torch.save's bytes are counted), by the rank that holds it
  - load puts back bit for bit what was saved; on 3 ranks training goes on as uninterrupted (fp32)
  - on the same 2 ranks: each rank's RNG state back, and bit for bit the uninterrupted run
Rules: no torch.distributed.checkpoint (async_)save, load, save/load_state_dict, no minidist.checkpoint save/load (see the README, "Exercises and grading").
Grade: python -m exercises.grade 08 (--hint for a hint; --reference grades minidist's own).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist


# ============================================================================ written for you

def param_names(model) -> dict:
    """{id(p): name} for the model's parameters (a tied parameter: its first name)."""
    return {id(p): name for name, p in model.named_parameters()}


def layout_of(u, names: dict) -> list[tuple[str, int, int]]:
    """A ShardedOptimizer unit's layout, for pieces_of: u.params are already in layout
    order (sorted by param group), so giving them all group 0 keeps that order."""
    return [(names[id(p)], p.numel(), 0) for p in u.params]


def shard_state(opt, u) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's optimizer state for unit u: ({k: a flat tensor laid out like u.shard},
    {k: 0-dim state}). The inner optimizer keeps its state per shard view (one per param
    group the shard meets: opt.shard_views lists (view, its unit, its start in u.shard));
    here the views' moments (AdamW: exp_avg, exp_avg_sq) are put back side by side, zeros
    where the shard holds padding. The 0-dim state (AdamW's step) is the same for all."""
    flats, scalars = {}, {}
    for view, unit, a in opt.shard_views:
        if unit is not u:
            continue
        for k, t in opt.state.get(view, {}).items():
            if t.dim() == 0:
                scalars[k] = t.clone()
            else:
                flats.setdefault(k, torch.zeros_like(u.shard))[a:a + view.numel()] = t.view(-1)
    return flats, scalars


def set_shard_state(opt, u, flats: dict, scalars: dict) -> None:
    """The reverse of shard_state: each shard view of unit u gets its slice of each flat
    (laid out like u.shard), and a copy of each 0-dim state."""
    for view, unit, a in opt.shard_views:
        if unit is not u:
            continue
        state = opt.state[view]
        for k, flat in flats.items():
            state[k] = flat[a:a + view.numel()].clone().view_as(view)
        for k, t in scalars.items():
            state[k] = t.clone()


# ============================================================================ part 1

def pieces_of(layout: list, rank: int, world: int) -> list[tuple[str, int, int, int]]:
    """[(name, start, a, b)]: the elements [a, b) of the unit's padded flat buffer that
    rank `rank` of `world` holds, each the elements [start, start + b - a) of parameter
    `name`. layout: [(name, numel, param group)] in bucket order."""
    order = sorted(layout, key=lambda e: e[2])  # the unit's layout: by param group, stable
    chunk = -(-sum(numel for _, numel, _ in order) // world)  # S = ceil(total / N)
    lo, hi = rank * chunk, (rank + 1) * chunk
    out, offset = [], 0
    for name, numel, _ in order:
        a, b = max(lo, offset), min(hi, offset + numel)
        if a < b:
            out.append((name, a - offset, a, b))
        offset += numel
    return out


# ============================================================================ part 2

def read(pieces: dict, key: str, start: int, n: int) -> torch.Tensor:
    """Elements [start, start + n) of the flattened tensor `key`, copied out of the pieces
    {key: [(piece_start, tensor)]} that overlap them; ValueError if some are in none."""
    chunks = pieces[key]  # KeyError: no piece of it at all
    out = torch.empty(n, dtype=chunks[0][1].dtype)
    covered = torch.zeros(n, dtype=torch.bool)
    for s, t in chunks:
        a, b = max(start, s), min(start + n, s + t.numel())
        if a < b:
            out[a - start:b - start] = t[a - s:b - s]
            covered[a - start:b - start] = True
    if not covered.all():
        raise ValueError(f"{key}: element {start + int((~covered).nonzero()[0])} is in no piece")
    return out


# ============================================================================ part 3

def save(root, step: int, model, opt) -> Path:
    """Write checkpoint root/step_{step:08d} atomically (a collective); return its Path."""
    rank, world = dist.get_rank(), dist.get_world_size()
    final = Path(root) / f"step_{step:08d}"
    tmp = final.with_name(".tmp_" + final.name)  # hidden: not a checkpoint until renamed
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed save of this step left
        tmp.mkdir(parents=True)
    dist.barrier()  # the folder exists before anyone writes into it
    names = param_names(model)
    pieces, scalars = [], {}
    for u in opt.units:
        flats, sc = shard_state(opt, u)
        scalars.update(sc)
        for name, start, a, b in pieces_of(layout_of(u, names), rank, world):
            # clone: torch.save writes a view's whole storage
            pieces.append((f"model/{name}", start, u.flat[a:b].clone()))
            for k, flat in flats.items():
                pieces.append((f"optim/{name}/{k}", start, flat[a - u.lo:b - u.lo].clone()))
    shard = {"pieces": pieces, "scalars": scalars, "rng": torch.get_rng_state(),
             "step": step, "world": world, "rank": rank}
    part = tmp / f".rank_{rank:05d}.partial"
    torch.save(shard, part)
    os.replace(part, tmp / f"rank_{rank:05d}.pt")
    dist.barrier()  # every rank's file is written
    if rank == 0:
        os.replace(tmp, final)  # the moment the checkpoint exists, whole
    dist.barrier()  # nobody reads it before it is there
    return final


def load(path, model, opt) -> int:
    """Fill model and opt from checkpoint `path` (saved on any number of ranks); restore
    this rank's RNG state if the number of ranks is the one that saved; return the step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    files = [torch.load(f, weights_only=True) for f in sorted(Path(path).glob("rank_*.pt"))]
    pieces = {}
    for f in files:
        for key, start, t in f["pieces"]:
            pieces.setdefault(key, []).append((start, t))
    names = param_names(model)
    moments = sorted({key.rsplit("/", 1)[1] for key in pieces if key.startswith("optim/")})
    with torch.no_grad():
        for name, p in model.named_parameters():  # replicated: every rank reads them whole
            p.view(-1).copy_(read(pieces, f"model/{name}", 0, p.numel()))
        for u in opt.units:  # sharded: this rank's part of the moments, on this world size
            flats = {k: torch.zeros_like(u.shard) for k in moments}
            for name, start, a, b in pieces_of(layout_of(u, names), rank, world):
                for k in moments:
                    flats[k][a - u.lo:b - u.lo] = read(pieces, f"optim/{name}/{k}", start, b - a)
            set_shard_state(opt, u, flats, files[0]["scalars"])
    if files[0]["world"] == world:  # the same ranks: each gets its own RNG stream back
        torch.set_rng_state(next(f["rng"] for f in files if f["rank"] == rank))
    return files[0]["step"]


# Where minidist implements each (through adapters in exercises/grader/checks_08.py);
# `python -m exercises.grade 08 --reference` grades these instead. Leave it as it is.
REFERENCE = {
    "pieces_of": "exercises.grader.checks_08:reference_pieces_of",
    "read": "exercises.grader.checks_08:reference_read",
    "save": "exercises.grader.checks_08:reference_save",
    "load": "exercises.grader.checks_08:reference_load",
}
