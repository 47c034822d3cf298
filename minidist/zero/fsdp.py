"""ZeRO-3 in FSDP2's shape: fully_shard(module) per block, bottom-up, and a mixed-precision
policy. Chapter 06 (chapters/06_zero.appendix.md, section F, "ZeRO-3 as FSDP2 does it"). Exercised by
`pytest tests/test_fsdp.py`.

    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mp_policy=...)              # the root: what no block holds
    opt = torch.optim.AdamW(model.parameters())    # any optimizer: it steps the shards

Each call puts the module's own parameters (those no fully_shard-ed submodule holds) in one
flat padded unit (layout.py's Unit, as every ZeRO stage) and registers this rank's piece of
each, fp32 masters in fp32, under its original name: module.parameters() yields the shards.
The hooks here say when; gathering, freeing, prefetch and the reduce-scatters are base.py's
ShardSync, the machinery FullyShardedOptimizer runs on, driven by fsdp_sync.py's
ShardedModules. A shard is this rank's elements of the unit's slice, so a parameter may be
cut anywhere, or be empty on a rank (FSDP2 cuts each parameter by rows instead): an
elementwise optimizer does not mind.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from minidist.zero.fsdp_sync import ShardedModules
from minidist.zero.layout import Unit


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As torch.distributed.fsdp.MixedPrecisionPolicy. param_dtype: what the gathered
    parameters, hence forward and backward, compute in (None: the parameters' own); the
    shards the optimizer steps keep theirs. reduce_dtype: the gradients' dtype in the
    reduce-scatter (None: the compute dtype, as torch's)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy({name}={dtype!r}): pass a floating-point torch.dtype "
                                 f"(torch.bfloat16, torch.float16, torch.float32) or None")


_STATE = weakref.WeakKeyDictionary()  # module -> its ModuleShards
_OWNER = WeakIdKeyDictionary()  # parameter (original, gathered or shard) -> its ModuleShards


def state_of(module: nn.Module):
    """The ModuleShards fully_shard attached to `module`, or None."""
    return _STATE.get(module)


def fully_shard(module, *, group=None, mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True):
    """Shard `module`'s own parameters over `group` (all ranks by default); returns it. A
    list of modules is one unit, gathered when any of them runs (FSDP2's way for a tied
    embedding and head). reshard_after_forward=False keeps the parameters gathered from
    forward until backward has used them: one all-gather fewer per step, more memory held."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    _check(modules, group, mp_policy, reshard_after_forward)
    ModuleShards(modules, group, mp_policy or MixedPrecisionPolicy(), reshard_after_forward)
    return module


def _check(modules, group, mp_policy, reshard_after_forward) -> None:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs a process group: call minidist.dist.init() "
                           "(or torch.distributed.init_process_group) first")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard takes an nn.Module or a list of them, got {type(m).__name__}")
        if m in _STATE:
            raise ValueError(f"{type(m).__name__} is already fully_shard-ed: apply fully_shard once per "
                             "module, bottom-up (the blocks first, the root last)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        hint = ": pass mesh.get_group(), one of its process groups" if hasattr(group, "get_group") else ""
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None (every rank), "
                        f"got {type(group).__name__}{hint}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be minidist.zero.MixedPrecisionPolicy(param_dtype=..., "
                        f"reduce_dtype=...) or None, got {type(mp_policy).__module__}.{type(mp_policy).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")


class ModuleShards:
    """What one fully_shard call keeps: its modules, its units (the trainable parameters in
    one, the frozen in another: they get no gradient), each parameter's gathered tensor
    (`params` of the unit, in the compute dtype, a view of its flat buffer), its shard
    (an nn.Parameter viewing the unit's shard) and where it is registered."""

    def __init__(self, modules: list[nn.Module], group, policy: MixedPrecisionPolicy, reshard: bool):
        self.modules, self.group, self.policy, self.reshard = modules, group, policy, reshard
        self.engine = None  # the ShardedModules of the root above: set by FSDP or the first forward
        places = self._own_places(modules)
        if len({(p.dtype, p.device) for p in places}) > 1:
            raise ValueError("fully_shard: one call's parameters must share one dtype and device; got "
                             f"{sorted({f'{p.dtype} on {p.device}' for p in places})}: shard the modules apart")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        trainable = [p for p in places if p.requires_grad]
        frozen = [p for p in places if not p.requires_grad]
        self.units = [Unit(ps, {p: 0 for p in ps}, rank, world) for ps in (trainable, frozen) if ps]
        self.grad_units = self.units[:1] if trainable else []
        self.places, self.shards = {}, {}  # unit -> per parameter: [(module, name)]; (shard, a, b)
        for u in self.units:
            self._shard(u, [places[p] for p in u.params])
        for m in modules:
            _STATE[m] = self
            m.register_forward_pre_hook(self._before_forward)
            m.register_forward_hook(self._after_forward)

    @staticmethod
    def _own_places(modules) -> dict:
        """Each parameter of `modules` that no fully_shard-ed submodule holds: where it is
        registered, [(module, attribute name)], in registration order."""
        places, seen = {}, set()

        def walk(m):
            seen.add(m)
            for name, p in m._parameters.items():
                if p is None:
                    continue
                if p in _OWNER:
                    other = ", ".join(type(o).__name__ for o in _OWNER[p].modules)
                    raise ValueError(f"{type(m).__name__}.{name} is already sharded by fully_shard([{other}]): "
                                     "apply fully_shard bottom-up (the blocks first, the root last), and a tied "
                                     "weight in one call over every module using it: fully_shard([a, b]) or "
                                     "their parent")
                places.setdefault(p, []).append((m, name))
            for c in m.children():
                if c not in _STATE and c not in seen:
                    walk(c)
        for m in modules:
            walk(m)
        return places

    @torch.no_grad()
    def _shard(self, u: Unit, places: list) -> None:
        """u's parameters become gathered tensors (in the compute dtype) over its freed flat
        buffer, and shards (in theirs) over u.shard, registered where the originals were."""
        originals = list(u.params)  # the master shard lives on; the full buffer, in the compute dtype, is freed
        views = u.keep_shard(self.policy.param_dtype, self.policy.reduce_dtype)  # (as FullyShardedOptimizer's)
        u.params = [_view_parameter(v, p.requires_grad) for p, v in zip(originals, views)]
        self.shards[u], offset = [], 0
        for p, where in zip(originals, places):
            a, b = max(offset, u.lo) - u.lo, min(offset + p.numel(), u.hi) - u.lo
            a, b = (a, b) if a < b else (0, 0)  # none of p on this rank: an empty shard
            shard = nn.Parameter(u.shard[a:b], requires_grad=p.requires_grad)
            self.shards[u].append((shard, a, b))
            for m, name in where:
                m._parameters[name] = shard
            offset += p.numel()
        self.places[u] = places
        for p in originals + u.params + [s for s, _, _ in self.shards[u]]:
            _OWNER[p] = self

    def swap(self, u: Unit, gathered: bool) -> None:
        """Register u's gathered tensors where its shards were (forward and backward
        compute with them), or the shards back."""
        for full, (shard, _, _), where in zip(u.params, self.shards[u], self.places[u]):
            for m, name in where:
                m._parameters[name] = full if gathered else shard

    def ensure_engine(self) -> ShardedModules:
        """This module's ShardedModules; the first time, it becomes the root of one over
        every fully_shard-ed module under it (FSDP2's lazy init at the root's first forward)."""
        if self.engine is None:
            ShardedModules(states_under(self.modules), self.group, root=self)
        return self.engine

    # ---- hooks ---------------------------------------------------------------------------

    def _before_forward(self, module, args):
        self.ensure_engine().before(self)
        dtype = self.policy.param_dtype
        if dtype is not None:  # floating-point positional inputs in the compute dtype, as torch's default
            return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    def _after_forward(self, module, args, out) -> None:
        self.engine.after(self, out)


def _view_parameter(view: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """A parameter over `view`'s storage with a version counter of its own, as stage 3's
    p.data = view: gathering again writes into the buffer, which must not look to autograd
    like an in-place change of a tensor it saved for backward."""
    p = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=requires_grad)
    p.data = view
    return p


def states_under(modules) -> list[ModuleShards]:
    """The ModuleShards of every module under `modules` (themselves included), once each,
    in registration order."""
    found = {}
    for m in modules:
        for sub in m.modules():
            if sub in _STATE:
                found.setdefault(_STATE[sub], None)
    return list(found)


def full_state_dict(module: nn.Module, rank0_only: bool = False) -> dict:
    """Every parameter of `module`, whole, by its name in module.named_parameters(), on
    every rank (rank0_only: on rank 0; the others get {}, after joining the all-gathers)."""
    engines = list(dict.fromkeys(s.ensure_engine() for s in states_under([module])))
    full = {}
    for engine in engines:
        full.update(engine.full_tensors())
    group = engines[0].group if engines else None
    if rank0_only and dist.get_rank(group) != 0:
        return {}
    return {name: full.get(id(p), p).detach().clone() for name, p in module.named_parameters()}
