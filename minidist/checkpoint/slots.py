"""What a rank holds of a checkpoint's tensors, and which rank writes each piece.
Chapter 08 (chapters/08_at_scale.md), with chapter 10's tensor-parallel shards. Exercised
by `pytest tests/test_checkpoint.py tests/test_checkpoint_tp.py` and by

    torchrun --standalone --nproc_per_node=4 minidist/train_gpt.py --tp 2 --zero-stage 1 --checkpoint-every 50
    torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py --tp 1 --resume auto   # the same run, resplit

A slot is a 1-D tensor and its runs (offset in the slot, start in the full tensor, n):
one run for a replicated parameter, ZeRO's piece or a row shard; one per row for a column
shard. A parameter marks itself a shard with `p.tp_shard = (dim, ((start, stop), ...))`.
Of the ranks holding the same elements exactly one writes them (largest first, to the rank
with the fewest bytes so far); optimizer state follows its parameter.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from minidist.dist import rank_and_world


class Slot(NamedTuple):
    """Elements of the flattened tensor `key` (full shape `shape`) live in `tensor` (1-D) on
    this rank: tensor[o:o + n] are the key's [s, s + n) for each (o, s, n) in `runs`.
    `write`: this rank is the one that saves them."""
    key: str
    shape: tuple
    runs: tuple
    tensor: torch.Tensor
    write: bool = True


def flat_runs(full_shape: tuple, spec) -> tuple:
    """The runs (offset in the shard, start in the full tensor, n) of a shard that holds the
    slice `spec` = (dim, ((start, stop), ...)) of a tensor of `full_shape` (None: all of
    it), in the shard's own flattened order (torch.cat of the ranges along dim)."""
    if spec is None:
        return ((0, 0, math.prod(full_shape)),)
    dim, ranges = spec
    outer, size, inner = math.prod(full_shape[:dim]), full_shape[dim], math.prod(full_shape[dim + 1:])
    runs, off = [], 0
    for o in range(outer):
        for a, b in ranges:
            start, n = (o * size + a) * inner, (b - a) * inner
            if runs and runs[-1][0] + runs[-1][2] == off and runs[-1][1] + runs[-1][2] == start:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)  # consecutive in both
            elif n:
                runs.append((off, start, n))
            off += n
    return tuple(runs)


def cut_runs(runs: tuple, lo: int, hi: int) -> tuple:
    """The runs of a slot's elements [lo, hi) alone, offsets counted from lo."""
    out = []
    for o, s, n in runs:
        a, b = max(o, lo), min(o + n, hi)
        if a < b:
            out.append((a - lo, s + a - o, b - a))
    return tuple(out)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Layout:
    """This rank's part of a checkpoint of `model` and its optimizers: each parameter's
    full shape and runs, who writes it and its state. A collective: one all-gather of what
    each rank holds (names, shapes, tensor-parallel slices), when the world has ranks.
    Ranks may hold different tensors (pipeline stages), so every rank learns what every
    rank holds."""

    def __init__(self, model):
        self.rank, world = rank_and_world()
        self.names = {id(p): n for n, p in model.named_parameters()}  # a tied one: its first name
        params = list({id(p): p for p in model.parameters()}.values())
        persistent = set(model.state_dict())
        self.buffers = [(n, b) for n, b in model.named_buffers() if n in persistent]
        # what this rank holds, by name: (shape here, tensor-parallel slice or None, bytes)
        mine = tuple(sorted([(self.names[id(p)], (tuple(p.shape), _spec(getattr(p, "tp_shard", None)), _nbytes(p)))
                             for p in params] + [(n, (tuple(b.shape), None, _nbytes(b))) for n, b in self.buffers]))
        everyone = [mine] * world
        if world > 1:
            dist.all_gather_object(everyone, mine)
        held = [dict(sig) for sig in everyone]
        self.all_names = set().union(*held)  # every tensor some rank holds
        self.replicas = [r for r in range(world) if everyone[r] == mine]  # cut and placed like this rank
        first = {sig: min(r for r in range(world) if everyone[r] == sig) for sig in set(everyone)}
        self.cut_like = [first[sig] for sig in everyone]  # rank -> the first rank that holds the same
        self.shape, self.runs = {}, {}
        for name, (shape, spec, _) in mine:
            full = shape if spec is None else _full_shape(
                name, shape, spec, list(dict.fromkeys(h[name][1] for h in held if name in h)))
            self.shape[name], self.runs[name] = full, flat_runs(full, spec)
        # writers: of the ranks that hold the same elements (a name and a slice), one, largest
        # first, each to the rank with the fewest bytes so far: files of about the same size
        holders = {}
        for r, h in enumerate(held):
            for name, (_, spec, nbytes) in h.items():
                holders.setdefault((name, spec), (nbytes, []))[1].append(r)
        keys = sorted(holders, key=lambda k: (-holders[k][0], k[0], repr(k[1])))
        load, who = dict.fromkeys(range(world), 0), {}
        for k in keys:
            nbytes, ranks = holders[k]
            who[k] = min(ranks, key=lambda r: (load[r], r))
            load[who[k]] += nbytes
        self.writer = {n: who[n, spec] for n, (_, spec, _) in mine}  # by name

    def writes(self, p) -> bool:
        """Whether this rank saves parameter p (and its state, when that is replicated too)."""
        return self.writer[self.names[id(p)]] == self.rank

    def writes_pieces(self, p, opt=None) -> bool:
        """Whether this rank saves its pieces of p's state sharded (ZeRO) over `opt`'s group:
        if p's writer is in that group, every rank of it writes its pieces (ranks that hold
        other tensors, chapter 13's experts, may share it); without a group, the ranks cut
        and placed like p's writer do."""
        writer = self.writer[self.names[id(p)]]
        members = _members(opt)
        if members is not None:
            return writer in members
        return self.cut_like[writer] == self.cut_like[self.rank]

    def slots(self, model, optimizers) -> list[Slot]:
        """The parameters and persistent buffers: a parameter that an optimizer holds only as
        pieces (ZeRO-3: state_pieces()'s params) is saved piece by piece; any other one is
        whole here (or this rank's tensor-parallel shard), and one of its holders writes it."""
        slots = [Slot(f"model/{n}", tuple(b.shape), flat_runs(tuple(b.shape), None), b.view(-1),
                      self.writer[n] == self.rank) for n, b in self.buffers]
        pieces = [(o, piece) for o in optimizers if hasattr(o, "state_pieces") for piece in o.state_pieces()[1]]
        for o, (p, start, t) in pieces:
            if t.numel():  # (an empty piece: sharded, but none of it on this rank)
                n = self.names[id(p)]
                slots.append(Slot(f"model/{n}", self.shape[n], cut_runs(self.runs[n], start, start + t.numel()),
                                  t, self.writes_pieces(p, o)))
        pieces = [piece for _, piece in pieces]
        in_pieces = {id(p) for p, _, _ in pieces}
        params = [p for p in {id(p): p for p in model.parameters()}.values() if id(p) not in in_pieces]
        return slots + [Slot(f"model/{self.names[id(p)]}", self.shape[self.names[id(p)]],
                             self.runs[self.names[id(p)]], p.detach().view(-1), self.writes(p))
                        for p in params]

    def holders(self, opt):
        """(name, full shape, runs, holder, cut, write) for each range of a parameter's
        elements whose optimizer state lives in `holder` (a key of opt.state) on this rank:
        the state's elements `cut` = (a, b) of the holder (None: all of them), whose runs
        (offsets from a) say where they sit in the full tensor. `write`: this rank saves it.
        A sharding optimizer (ZeRO, Muon) says what it holds through opt.state_pieces(); any
        other is replicated, and each parameter's writer writes its state."""
        if hasattr(opt, "state_pieces"):
            for p, start, holder, a, b in opt.state_pieces()[0]:
                n = self.names[id(p)]
                yield (n, self.shape[n], cut_runs(self.runs[n], start, start + b - a), holder, (a, b),
                       self.writes_pieces(p, opt))
            return
        for p in (p for g in opt.param_groups for p in g["params"]):
            n = self.names[id(p)]
            yield n, self.shape[n], self.runs[n], p, None, self.writes(p)


def _members(opt) -> set | None:
    """The global ranks a sharding optimizer shards over (its `group`; None: not said)."""
    if opt is None or not hasattr(opt, "group") or not dist.is_initialized():
        return None
    return set(range(dist.get_world_size())) if opt.group is None else set(dist.get_process_group_ranks(opt.group))


def _spec(spec) -> tuple | None:
    if spec is None:
        return None
    dim, ranges = spec
    return int(dim), tuple((int(a), int(b)) for a, b in ranges)


def _full_shape(name: str, shape: tuple, spec: tuple, specs: list) -> tuple:
    """The full tensor's shape, from this shard's and every differently cut rank's `specs`,
    whose ranges must tile the full size along dim exactly once."""
    dim = spec[0]  # (specs: each differently cut slice once; the tied embedding is on two stages)
    ranges = sorted(r for s in specs if s is not None for r in s[1])
    size = ranges[-1][1]
    tiled = all(s is not None and s[0] == dim for s in specs) and ranges[0][0] == 0 and \
        all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    if not tiled or sum(b - a for a, b in spec[1]) != shape[dim]:
        raise ValueError(f"{name}: the tensor-parallel shards of the ranks do not tile one full tensor "
                         f"(dim {dim}, ranges {ranges}): every rank must hold a slice of the same model")
    return shape[:dim] + (size,) + shape[dim + 1:]


class PieceIndex:
    """A checkpoint's pieces of each key sorted by start, so that filling a range finds the
    pieces it overlaps by bisection (a tensor saved by rows has thousands of pieces). The
    Reader (minidist/checkpoint/io.py) has checked that they cover each key exactly once."""

    def __init__(self, reader):
        self.reader, self.sorted = reader, {}

    def fill(self, dest: torch.Tensor, key: str, runs) -> None:
        """dest[o:o + n] = elements [s, s + n) of `key`, for each run (o, s, n)."""
        if key not in self.sorted:
            ps = sorted(((s, t) for s, t in self.reader.pieces[key] if t.numel()), key=lambda st: st[0])
            self.sorted[key] = ([s for s, _ in ps], ps)
        starts, ps = self.sorted[key]
        buf = dest if dest.device.type == "cpu" else torch.empty(dest.numel(), dtype=dest.dtype)
        for o, s, n in runs:
            i = bisect.bisect_right(starts, s) - 1
            while n > 0:
                first, t = ps[i]
                m = min(n, first + t.numel() - s)
                buf[o:o + m] = t[s - first:s - first + m]
                o, s, n, i = o + m, s + m, n - m, i + 1
        if buf is not dest:
            dest.copy_(buf)  # one copy to the device, not one per row
