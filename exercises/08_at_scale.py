"""Exercise 08: a sharded checkpoint that resumes on a different number of ranks.

Chapter 08 (chapters/08_at_scale.md) saves a ZeRO run the way large runs are saved: every
rank writes only what it holds (no rank gathers the model, which at scale would not fit
in one memory), and the checkpoint can be loaded by any number of ranks. The trick is how
a piece of it is named. Not "rank 3's shard", which means nothing to a run on 2 ranks, but

    (key, start, tensor):  elements [start, start + tensor.numel()) of the flattened tensor `key`

where the key is a parameter's name ("model/blocks.0.mlp.c_fc.weight") or one of its
optimizer state's ("optim/blocks.0.mlp.c_fc.weight/exp_avg"). Resuming on M ranks, each
rank works out which elements of which keys it now holds, and copies them from whichever
saved pieces overlap them, whatever N wrote them.

The layout (chapter 06, minidist.zero.Unit): the parameters of a bucket live in one flat
buffer. Its parameters are laid out SORTED BY PARAM GROUP (a stable sort: within a group
they keep the bucket's order), back to back, and the buffer is PADDED with zeros to a
multiple of the world size N. Rank r owns elements [r*S, (r+1)*S) of it, S = ceil(total/N).
A parameter may straddle two ranks (or several, when it is longer than S), and a rank may
hold only padding. What a unit `u` of a minidist.zero.ShardedOptimizer holds:

    u.params       its parameters, in layout order (each p.data a view into u.flat)
    u.flat         the padded flat buffer of parameters
    u.chunk        S;   u.lo, u.hi = r*S, (r+1)*S;   u.shard = u.flat[u.lo:u.hi]

and opt.units lists the units (the same units, in the same order, on every number of
ranks: only their padding and cut points change).

Implement, replacing each `raise NotImplementedError(...)`:

part 1, pieces_of(layout, rank, world): which elements of which parameter this rank holds.
  layout: [(name, numel, group), ...], a unit's parameters in the order the bucket got them
  (not yet sorted by group). Return [(name, start, a, b), ...]: for each parameter with at
  least one element in [r*S, (r+1)*S), the overlap [a, b) in the unit's flat coordinates
  (0 = the buffer's first element) and `start`, where that overlap begins within the
  flattened parameter. No piece for padding, no empty piece, no element twice.

part 2, read(pieces, key, start, n): elements [start, start + n) of the flattened tensor
  `key`, from pieces = {key: [(piece_start, tensor), ...]} (the pieces come in any order;
  in a checkpoint no two of them overlap). A range some element of which is in no piece
  is a damaged checkpoint: raise ValueError (KeyError for a key not there at all). The
  result has the pieces' dtype.

part 3, save(root, step, model, opt) and load(path, model, opt) for a ShardedOptimizer
  (stage 1 or 2: the weights are replicated on every rank, the AdamW moments sharded).
  Both are collectives: every rank calls them. Chapter 08, sections 1 to 3.

  save writes root/step_{step:08d} (eight digits: step_00000002) and returns that Path.
  - Every rank writes only what it holds, with torch.save (the grader watches torch.save
    and counts the bytes it writes: each element once, over all ranks), as pieces named
    (key, start, tensor) with the keys above: "model/" + name for a parameter,
    "optim/" + name + "/" + k for its AdamW moment k. No rank gathers the model.
  - Everything an exact resume needs: the weights, the moments, AdamW's 0-dim state (its
    step counter: the bias correction depends on it), each rank's RNG state, the step
    and the world size.
  - Atomically: a kill at any moment leaves the new checkpoint whole or invisible and
    the previous ones untouched, and saving again afterwards works. A folder whose name
    starts with "." is not a checkpoint.

  load fills the model and the optimizer from checkpoint `path`, saved by any number of
  ranks, and returns the step it was saved at (the caller continues from there):
  - every rank gets every parameter whole (the weights are replicated), and the moments
    and the step counter of its own shard;
  - when the checkpoint was saved by as many ranks as load runs on, rank r gets rank r's
    RNG state back, so that dropout draws the masks the uninterrupted run would have; on
    another number of ranks the RNG is left alone.
  The learning rate and the other hyperparameters are the caller's: it builds the
  optimizer with them and sets the learning rate from the step.

Written for you below: param_names, layout_of, shard_state, set_shard_state.

The grader checks pieces_of and read here, in this process, against layouts sharded and
reassembled independently (N from 1 to 8, padding, parameters straddling ranks or longer
than a shard, param groups interleaved, ranks holding only padding; gaps at the start,
the middle and the end). Then it trains a small GPT (AdamW, two param groups, a learning
rate that changes every step) with ZeRO-2 on 4 ranks and saves at step 2 with your save;
loads that on 2 ranks (ZeRO-1) with your load, trains a step and saves; loads that on 3
ranks and trains to step 5; loads the 4-rank checkpoint on 1 rank and trains to step 5.
What load puts back must be exactly what was saved, and training must continue as one
process with plain AdamW on the same batches does, up to float32 rounding (on another
number of ranks the gradients are averaged in another order). On the same 4 ranks, with
dropout, the resumed run must equal the uninterrupted one to the bit. It counts the bytes
your torch.save calls write (each element once). And it kills your save (in one process)
at every moment it can see: while and just after each file is written (torch.save,
Path.write_text, json.dump), just before and just after each os.replace or os.rename,
after which the folder must hold the previous checkpoint untouched, the new one only if
it loads, and saving again must work. Grade your work with

    python -m exercises.grade 08

(about 7 s on a quiet 2-core machine: it starts 4, 2, 3 and 1 processes), and see what
full marks look like with `python -m exercises.grade 08 --reference`, which grades
minidist's own implementation (minidist/checkpoint/sharded.py, through the adapters named in
REFERENCE below) instead of yours. A rank that waits more than 20 seconds for the
others (a hang) fails its check.

Ask for a hint on the first failing check with `python -m exercises.grade 08 --hint`
(again for the next one; `--hint K` for the K-th).

To experiment, run a function of your own on several processes with
`minidist.launch.launch(fn, 2, *args)`: it returns each rank's return value and re-raises a
rank's exception here, with "[rank r of 2]" in front.
"""

from __future__ import annotations

import os  # noqa: F401 - for you: os.replace
import shutil  # noqa: F401 - for you: shutil.rmtree
from pathlib import Path

import torch
import torch.distributed as dist  # noqa: F401 - for you: get_rank, get_world_size, barrier


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
    raise NotImplementedError(
        "pieces_of is not written yet (`python -m exercises.grade 08 --hint` gives a hint)")


# ============================================================================ part 2

def read(pieces: dict, key: str, start: int, n: int) -> torch.Tensor:
    """Elements [start, start + n) of the flattened tensor `key`, copied out of the pieces
    {key: [(piece_start, tensor)]} that overlap them; ValueError if some are in none."""
    raise NotImplementedError(
        "read is not written yet (`python -m exercises.grade 08 --hint` gives a hint)")


# ============================================================================ part 3

def save(root, step: int, model, opt) -> Path:
    """Write checkpoint root/step_{step:08d} atomically (a collective); return its Path."""
    raise NotImplementedError(
        "save is not written yet (`python -m exercises.grade 08 --hint` gives a hint)")


def load(path, model, opt) -> int:
    """Fill model and opt from checkpoint `path` (saved on any number of ranks); restore
    this rank's RNG state if the number of ranks is the one that saved; return the step."""
    raise NotImplementedError(
        "load is not written yet (`python -m exercises.grade 08 --hint` gives a hint)")


# Where minidist implements each (minidist/checkpoint/sharded.py and minidist.zero.Unit.pieces,
# through thin adapters that give its save, load, Reader.read and pieces these signatures); `python -m exercises.grade
# 08 --reference` grades these instead of the stubs above. Leave it as it is.
REFERENCE = {
    "pieces_of": "exercises.checks_08:reference_pieces_of",
    "read": "exercises.checks_08:reference_read",
    "save": "exercises.checks_08:reference_save",
    "load": "exercises.checks_08:reference_load",
}
