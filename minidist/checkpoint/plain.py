"""A sharded checkpoint in its plain form: each rank saves what it holds, rank 0 a small
meta file, all written under a temporary name and renamed into place. Chapter 08
(chapters/08_at_scale.md). Exercised by:

    pytest tests/test_simple_forms.py     # a round trip equal to minidist.checkpoint's save/load

Under data parallelism the model is the same on every rank, so rank 0 writes it once; the
optimizer state is not (distributed Muon keeps each momentum at its owner, ZeRO a shard
of every state), so each rank writes its own. Atomic: everything goes into a hidden
folder, and only when every rank has written (a barrier) does rank 0 rename it to its
name, so a kill at any moment leaves the whole checkpoint or none of it.

This plain form reads back on the world size that wrote it; minidist.checkpoint's save and
load name pieces by element ranges of the full tensors, so any world size or cut reads them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.dist import rank_and_world

__all__ = ["save", "load"]


def _barrier() -> None:
    if rank_and_world()[1] > 1:
        dist.barrier()


def save(root, step: int, model, optimizers) -> Path:
    """Write `root`/step_<step>/ (a collective: every rank calls it); returns its path."""
    rank, world = rank_and_world()
    final = Path(root) / f"step_{step:08d}"
    tmp = final.with_name(".tmp_" + final.name)
    if rank == 0:
        tmp.mkdir(parents=True)
    _barrier()  # the folder exists before anyone writes into it
    torch.save([o.state_dict() for o in optimizers], tmp / f"optim_rank{rank}.pt")
    if rank == 0:
        torch.save(model.state_dict(), tmp / "model.pt")
    _barrier()  # every rank's file is written
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": world}))
        os.replace(tmp, final)  # the moment the checkpoint exists, whole
    _barrier()  # nobody reads it before it is there
    return final


def load(path, model, optimizers) -> dict:
    """Fill `model` and `optimizers` (same kinds, same order) from checkpoint `path`, on the
    world size that saved it; returns the meta (the step)."""
    rank, world = rank_and_world()
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta["world_size"] != world:
        raise ValueError(f"{path} was saved by {meta['world_size']} ranks, and this is {world}: the "
                         "plain form cannot reshard; minidist.checkpoint.load can")
    model.load_state_dict(torch.load(path / "model.pt", map_location="cpu"))  # the one copy
    for o, state in zip(optimizers, torch.load(path / f"optim_rank{rank}.pt", map_location="cpu")):
        o.load_state_dict(state)
    return meta
