"""Where memory really is: the tensors a piece of code holds, found by looking, not asking.

`reachable(roots)`: every tensor reachable from some objects (attributes, containers,
.grad, closures, bound methods, the learner module's globals); `graph_saved(output)`: what
the autograd graph behind `output` holds for backward; `born_during()`: the tensors made
inside a block and still alive after it. Sizes are of storages, by the storage's address.
"""

import functools
import gc
import sys
import types

import torch


def tensors_in(x) -> list:
    """The tensors in x: a tensor, or lists and tuples of them (nested)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in tensors_in(y)]
    return []


def key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage behind `t`."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device,
          torch.Size, range, slice, type(Ellipsis))


def reachable(roots, modules=(), limit: int = 200_000) -> dict:
    """{storage address: (bytes, an example tensor)} of the tensors reachable from `roots`.
    `modules`: module names whose globals and classes are followed (the learner's)."""
    found: dict = {}
    seen: set = set()
    todo = list(roots)
    modules = set(modules)
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or issubclass(type(obj), _ATOMS):
            continue
        seen.add(id(obj))
        if issubclass(type(obj), torch.Tensor):
            if obj.device.type != "meta":
                k, nbytes = key(obj)
                found.setdefault(k, (nbytes, obj))
            if obj.grad is not None:
                todo.append(obj.grad)
            todo.extend(getattr(obj, "__dict__", {}).values())
            continue
        if issubclass(type(obj), dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
            continue
        if issubclass(type(obj), (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
            todo.extend(obj)
            continue
        if issubclass(type(obj), types.ModuleType):
            if obj.__name__ in modules:
                todo.extend(vars(obj).values())
            continue
        if issubclass(type(obj), type):
            if obj.__module__ in modules:
                todo.extend(vars(obj).values())
            continue
        if issubclass(type(obj), types.MethodType):
            todo += [obj.__self__, obj.__func__]
            continue
        if issubclass(type(obj), types.FunctionType):
            todo += [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            todo += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
            if obj.__module__ in modules:
                todo.append(sys.modules.get(obj.__module__))
            continue
        if issubclass(type(obj), functools.partial):
            todo += [obj.func, *obj.args, *obj.keywords.values()]
            continue
        if issubclass(type(obj), (types.BuiltinFunctionType, types.CodeType, types.FrameType)):
            continue
        if type(obj).__module__ in modules:
            todo.append(type(obj))
        todo.extend(getattr(obj, "__dict__", {}).values())
        for slot in getattr(type(obj), "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                try:
                    todo.append(getattr(obj, slot))
                except Exception:
                    pass
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def total(found: dict) -> int:
    """Bytes of the storages in `found` (from reachable, graph_saved, born_during)."""
    return sum(nbytes for nbytes, _ in found.values())


def storages(tensors) -> set:
    """The storage addresses of `tensors` (None skipped)."""
    return {key(t)[0] for t in tensors if t is not None}


_RNG_NUMEL = torch.get_rng_state().numel()


def is_rng_state(t: torch.Tensor) -> bool:
    """A generator's state (uint8, the size torch's CPU generator state has): what a
    recomputation keeps to draw the same numbers, not an activation."""
    return t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == _RNG_NUMEL


def graph_saved(output: torch.Tensor, modules=()) -> dict:
    """{storage address: (bytes, tensor)} of what the autograd graph behind `output` holds
    for backward. Parameters (the leaves' AccumulateGrad variables) are not saved tensors
    and are not counted unless a node saved them."""
    found: dict = {}
    seen, todo = set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "AccumulateGrad":
            continue
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except Exception:  # freed, or not a tensor
                    continue
                for t in tensors_in(value):
                    found.setdefault(key(t)[0], (key(t)[1], t))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            try:
                saved = node.saved_tensors
            except Exception:
                saved = ()
            for t in tensors_in(saved):
                found.setdefault(key(t)[0], (key(t)[1], t))
            found.update({k: v for k, v in reachable(list(getattr(node, "__dict__", {}).values()),
                                                     modules).items() if k not in found})
        for nxt, _ in node.next_functions:
            todo.append(nxt)
    return found


def _tensors_of(objects) -> dict:
    found = {}
    for obj in objects:
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            try:
                k, nbytes = key(obj)
            except Exception:  # a tensor without storage (sparse, a wrapper)
                continue
            found.setdefault(k, (nbytes, obj))
    return found


class born_during:
    """`with born_during() as new: ...`; afterwards new.tensors is {storage address:
    (bytes, tensor)} of the tensor objects made inside the block and still alive after
    it, wherever they are kept. (The collector is kept from running inside, so every
    object made there is still in its youngest generation; only that one is read.)"""

    def __enter__(self):
        gc.collect()
        self._was = gc.isenabled()
        gc.disable()
        self._before = {id(o) for o in gc.get_objects(generation=0)}
        return self

    def __exit__(self, *exc):
        young = [o for o in gc.get_objects(generation=0) if id(o) not in self._before]
        if self._was:
            gc.enable()
        self.tensors = _tensors_of(young)
