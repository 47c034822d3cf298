"""The device mesh: the world's ranks as a pp x dp x tp grid, one process group per line of
the grid; and MeshSync, the gradient sync of a dp x tp mesh. Chapter 10
(chapters/10_tensor_parallel.md) introduces it with two axes; chapter 11 adds the pipeline.
Exercised by tests/test_mesh.py and by
`torchrun --standalone --nproc_per_node=4 minidist/train_gpt.py --tp 2` (dp 2 x tp 2).

Rank r sits at pp_rank = r // (dp tp), dp_rank = (r // tp) % dp, tp_rank = r % tp: the tp
axis varies fastest, so a tp group's ranks are neighbours (one node's GPUs, the fastest
links: tensor parallelism talks inside every layer) and the pipeline stages, which exchange
the least, are farthest apart. Megatron-LM orders its axes the same way.

Chapter 12 splits the dp axis in two, dp x cp, cp varying faster (rank r of the dp line is
dp_rank cp + cp_rank): the cp ranks of a replica share its sequences, each holding a slice
of every one. For the gradient they count as data-parallel ranks (each holds its own
tokens' share), so the gradient sync runs over the whole dp x cp line, `dp_cp_group`, one
all-reduce; the data and the evaluation over `dp_group`, one rank per slice position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from minidist.dist import group_timeout
from minidist.sync import GradientSync


def coords(rank: int, dp: int, tp: int, pp: int = 1) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of global `rank` in a pp x dp x tp grid."""
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def rank_at(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    """The global rank at grid position (pp_rank, dp_rank, tp_rank)."""
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def axis_groups(dp: int, tp: int, pp: int = 1) -> dict[str, list[list[int]]]:
    """Every line of the grid, by axis: {"tp": [[ranks], ...], "dp": [...], "pp": [...]}."""
    cells = [(a, b, c) for a in range(pp) for b in range(dp) for c in range(tp)]
    lines = {"tp": {}, "dp": {}, "pp": {}}
    for a, b, c in cells:
        r = rank_at(a, b, c, dp, tp)
        lines["tp"].setdefault((a, b), []).append(r)   # same stage, same replica
        lines["dp"].setdefault((a, c), []).append(r)   # same stage, same slice
        lines["pp"].setdefault((b, c), []).append(r)   # same replica, same slice
    return {axis: list(groups.values()) for axis, groups in lines.items()}


def check_sizes(world: int, tp: int = 1, pp: int = 1, cp: int = 1) -> int:
    """dp = world / (tp * pp * cp), or a ValueError that says what to change."""
    for name, n in (("--tp", tp), ("--pp", pp), ("--cp", cp)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {n!r}")
    if world % (tp * pp * cp):
        axes, sizes = ("tp x pp x cp", f"{tp} x {pp} x {cp}") if cp > 1 else ("tp x pp", f"{tp} x {pp}")
        raise ValueError(f"the world of {world} ranks is not a multiple of {axes} = {sizes}: "
                         f"start a multiple of {tp * pp * cp} ranks, or change --tp / --pp{' / --cp' * (cp > 1)}")
    return world // (tp * pp * cp)


@dataclass
class Mesh:
    """This rank's place in the grid and its three groups."""
    dp: int
    tp: int
    pp: int
    rank: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    dp_group: object
    tp_group: object
    pp_group: object
    cp: int = 1            # chapter 12: the dp axis split into dp x cp
    cp_rank: int = 0
    cp_group: object = None
    dp_cp_group: object = None  # the gradient's: the dp x cp line (dp_group when cp is 1)

    def describe(self) -> str:
        return f"dp {self.dp} x {f'cp {self.cp} x ' if self.cp > 1 else ''}tp {self.tp} x pp {self.pp}"

    def where(self) -> str:
        """This rank and its groups' ranks, for an error: "rank 1 of dp 1 x tp 2 x pp 1 (tp
        group [0, 1], dp group [1], pp group [1])"; a timeout's own text names neither."""
        groups = ", ".join(f"{axis} group {dist.get_process_group_ranks(getattr(self, axis + '_group'))}"
                           for axis in ("tp", "dp", "pp") + ("cp",) * (self.cp > 1))
        return f"rank {self.rank} of {self.describe()} ({groups})"


def make_mesh(tp: int = 1, pp: int = 1, cp: int = 1) -> Mesh:
    """Split the default process group (which must exist) into this rank's dp, tp, pp (and
    cp) groups, each with the default group's timeout (a stopped peer is an error, not a
    hang). Every rank must call it, with the same sizes: creating a group is itself a
    collective, and every rank creates every group, in the same order, keeping its own."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = check_sizes(world, tp, pp, cp)
    mine, timeout = {}, group_timeout()  # the run's: torch's own default would be 30 minutes on gloo
    lines = axis_groups(dp * cp, tp, pp)  # its "dp" lines are the dp x cp lines
    if cp > 1:  # each dp x cp line, cut: cp consecutive ranks share sequences, every cp-th a slice
        lines["dp_cp"] = lines.pop("dp")
        lines["cp"] = [line[i:i + cp] for line in lines["dp_cp"] for i in range(0, len(line), cp)]
        lines["dp"] = [line[j::cp] for line in lines["dp_cp"] for j in range(cp)]
    for axis, ranks_of in lines.items():
        for ranks in ranks_of:  # collective: every rank makes every group
            g = dist.new_group(ranks, timeout=timeout, group_desc=f"{axis} group {ranks}")
            if rank in ranks:
                mine[axis] = g
    pp_rank, dpcp_rank, tp_rank = coords(rank, dp * cp, tp, pp)
    return Mesh(dp, tp, pp, rank, dpcp_rank // cp, tp_rank, pp_rank, mine["dp"], mine["tp"], mine["pp"],
                cp, dpcp_rank % cp, mine.get("cp"), mine.get("dp_cp", mine["dp"]))


class MeshSync(GradientSync):
    """The gradient-sync interface (minidist/sync.py) of a dp x tp mesh: `inner`, a DDP or a
    ZeRO optimizer over the dp group, averages each shard over the replicas; tensor
    parallelism adds only the norm for clipping: a split parameter's squares (it carries
    `tp_shard`) summed over the tp group, a replicated one's counted once (1/t on each rank)."""

    def __init__(self, inner, tp_group):
        self.inner, self.tp_group = inner, tp_group

    def no_sync(self):
        return self.inner.no_sync()

    def finish_gradient_synchronization(self) -> None:
        self.inner.finish_gradient_synchronization()

    def grad_square_sum(self, weight=None) -> torch.Tensor:
        t = dist.get_world_size(self.tp_group)

        def counted(p):
            w = 1.0 if weight is None else weight(p)
            return w if getattr(p, "tp_shard", None) is not None else w / t
        sq = self.inner.grad_square_sum(counted).reshape(1)  # whole over dp, the same on dp ranks
        dist.all_reduce(sq, group=self.tp_group)
        return sq[0]

    def scale_grads(self, coef) -> None:
        self.inner.scale_grads(coef)
