"""A whole model under ZeRO-3 in one call: FSDP(model, wrap=predicate, mp_policy=None).
Chapter 06 (chapters/06_zero.appendix.md, section F, "ZeRO-3 as FSDP2 does it"). Exercised by
`pytest tests/test_fsdp.py`.

    fsdp = FSDP(model)                            # each block, the embeddings, the root
    fsdp = FSDP(model, wrap=lambda m: isinstance(m, (nn.Linear, nn.Embedding)))
    opt = torch.optim.AdamW(fsdp.parameters())    # the shards, and the replicated parameters

fully_shard (fsdp.py) goes on every module `wrap` accepts, bottom-up; a parameter outside
them all stays whole on every rank and its gradient is averaged by an all-reduce when
backward ends, so the unwrapped modules stay in sync. Modules that share a parameter (a
tied embedding and head) are sharded together, in one unit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.sync import GradientSync
from minidist.zero.fsdp import MixedPrecisionPolicy, full_state_dict, fully_shard, state_of, states_under
from minidist.zero.fsdp_sync import ShardedModules


def default_wrap(model: nn.Module):
    """FSDP2 recipes' choice: each transformer block (model.blocks), the embeddings, the root."""
    blocks = {id(b) for b in getattr(model, "blocks", [])}
    return lambda m: m is model or id(m) in blocks or isinstance(m, nn.Embedding)


def wrap_groups(model: nn.Module, wrap) -> list[list[nn.Module]]:
    """The modules `wrap` accepts, as fully_shard calls in bottom-up order: one module each,
    except that modules sharing a parameter go in one call (one inside another: the outer
    one holds it). A parameter shared between a wrapped module and an unwrapped one is an
    error: it cannot be both sharded and whole."""
    order = {m: i for i, m in enumerate(_post_order(model))}  # children before parents
    accepted = [m for m in order if wrap(m)]
    owner = {}  # module -> the innermost accepted module around it (None: outside them all)

    def walk(m, around):
        owner[m] = m if m in accepted else around
        for c in m.children():
            walk(c, owner[m])
    walk(model, None)
    parent = {m: m for m in accepted}  # union-find over the accepted modules

    def find(m):
        while parent[m] is not m:
            m = parent[m]
        return m
    users = {}  # parameter -> [(its module's owner, the name it is registered by)]
    for name, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None:
                users.setdefault(p, []).append((owner.get(m), f"{name}.{attr}".lstrip(".")))
    for us in users.values():
        owners = list(dict.fromkeys(o for o, _ in us))
        if len(owners) > 1 and None in owners:
            raise ValueError(f"{', '.join(n for _, n in us)} are one parameter, which the wrap predicate would "
                             "both shard and keep whole: accept every module that uses it, or none")
        for o in owners[1:]:
            parent[find(o)] = find(owners[0])
    sets = {}
    for m in accepted:
        sets.setdefault(find(m), []).append(m)
    groups = []
    for members in sets.values():
        inside = {c for m in members for c in m.modules() if c is not m}
        groups.append([m for m in members if m not in inside])
    return sorted(groups, key=lambda g: max(order[m] for m in g))


def _post_order(m: nn.Module, seen=None) -> list[nn.Module]:
    seen = set() if seen is None else seen
    out = []
    for c in m.children():
        if c not in seen:
            seen.add(c)
            out += _post_order(c, seen)
    return out + [m]


class FSDP(GradientSync, nn.Module):
    """ZeRO-3 over `model` (`.module`): fully_shard on every submodule `wrap` accepts
    (default_wrap's by default), the rest replicated and averaged. The gradient-sync
    interface (minidist/sync.py): after backward, or finish_gradient_synchronization(),
    every gradient is the average over `group`'s ranks, in the shards' dtype. Rank 0's
    weights are broadcast first, so every rank shards the same model."""

    def __init__(self, model: nn.Module, wrap=None, mp_policy: MixedPrecisionPolicy | None = None,
                 group=None, reshard_after_forward: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(model).__name__}")
        if wrap is not None and not callable(wrap):
            raise TypeError(f"wrap must be a predicate, module -> bool (e.g. lambda m: isinstance(m, nn.Linear)), "
                            f"got {type(wrap).__name__}")
        if states_under([model]):
            raise ValueError("this model already has fully_shard-ed modules: FSDP applies fully_shard itself; "
                             "pass the plain model, or drive fully_shard yourself without FSDP")
        super().__init__()
        self.module = model
        groups = wrap_groups(model, wrap or default_wrap(model))  # before any work: errors first
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs a process group: call minidist.dist.init() first")
        with torch.no_grad():
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src, group=group)
        for g in groups:
            fully_shard(g if len(g) > 1 else g[0], group=group, mp_policy=mp_policy,
                        reshard_after_forward=reshard_after_forward)
        states = states_under([model])
        shards = {id(s) for st in states for u in st.units for s, _, _ in st.shards[u]}
        replicated = [p for p in model.parameters() if id(p) not in shards]
        self.sync = ShardedModules(states, group, root=state_of(model), replicated=replicated)
        if self.sync.root is None:  # the model is not sharded itself: its forward's end is ours to see
            model.register_forward_hook(lambda m, args, out: self.sync.root_done())

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return self.sync.no_sync()

    def finish_gradient_synchronization(self) -> None:
        self.sync.finish_gradient_synchronization()

    def grad_square_sum(self, weight=None) -> torch.Tensor:
        return self.sync.grad_square_sum(weight)

    def scale_grads(self, coef) -> None:
        self.sync.scale_grads(coef)

    def full_state_dict(self, rank0_only: bool = False) -> dict:
        """Every parameter whole, by its name in the model (as model.named_parameters()),
        on every rank, or on rank 0 only (the others get {})."""
        return full_state_dict(self.module, rank0_only)
