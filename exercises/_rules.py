"""The rules each exercise states, enforced while the learner's code runs, in every graded part.

An exercise's checks module declares its rules once, as a `Rules`; the grader runs each
part inside `watch(rules)`, which for the length of the part:

- makes the torch.distributed collectives the rules forbid trip: the ProcessGroup methods
  every dist.all_reduce, all_gather, broadcast, ... call ends in (whatever name the
  learner imported it under), the backends' own methods, and the functional collectives;
- makes the constructors of forbidden classes trip (torch's DistributedDataParallel does
  its all-reduces in C++, past any Python patch, but it is built in Python; so is
  ZeroRedundancyOptimizer, torch.optim.Muon, GradScaler), subclasses included;
- makes forbidden functions trip where they live and in their code object itself (a
  decorator's wrapper too, whose code reads a closure), so an alias imported before
  grading trips as well.

Below these Python-level tripwires, exercises/_traffic.py records every collective and
message where every road to gloo meets (torch's dispatcher), enforces `allowed` there too
and judges each call with the rules' `on_traffic`; what it sees is noted on the watch
(`Watch.note`: the part scores 0, the call goes on, so that no rank is left waiting).

`scan(obj)` finds forbidden module types anywhere in a module tree (fully_shard turns a
module into an FSDPModule without calling a constructor). A tripped rule raises RuleBroken
and is recorded even when the learner's code swallows the exception; the harness then
scores the part 0 with the message, which names the API and the rule. The grader's own
oracle runs its collectives inside `exempt()`, which only the grader's own files may enter.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

# Every ProcessGroup method that moves data other than send and recv. (barrier and
# monitored_barrier move no data and stay allowed.)
COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
               "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single",
               "all_gather_single_coalesced", "reduce_scatter", "reduce_scatter_single",
               "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
               "_reduce_scatter_base", "alltoall", "alltoall_base", "all_to_all_single",
               "broadcast", "reduce", "gather", "scatter")
# what the ProcessGroup methods are called from torch.distributed's side, for messages
_DIST_NAME = {"allreduce": "dist.all_reduce", "allgather": "dist.all_gather",
              "_allgather_base": "dist.all_gather_into_tensor",
              "all_gather_single": "dist.all_gather_into_tensor",
              "reduce_scatter": "dist.reduce_scatter",
              "_reduce_scatter_base": "dist.reduce_scatter_tensor",
              "reduce_scatter_single": "dist.reduce_scatter_tensor",
              "alltoall_base": "dist.all_to_all_single", "alltoall": "dist.all_to_all",
              "broadcast": "dist.broadcast", "reduce": "dist.reduce",
              "gather": "dist.gather", "scatter": "dist.scatter"}
# torch.distributed._functional_collectives: dispatched in C++, so watched by name
_FUNCTIONAL = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor",
               "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
               "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast")

TORCH_DDP = "torch.nn.parallel.DistributedDataParallel"
TORCH_FSDP = ("torch.distributed.fsdp.FullyShardedDataParallel",
              "torch.distributed.fsdp.FSDPModule", "torch.distributed.fsdp.fully_shard")


class RuleBroken(RuntimeError):
    """Raised where the learner's code called what its exercise forbids."""


@dataclass(frozen=True)
class Rules:
    """An exercise's rules. `allowed`: the ProcessGroup methods the learner may call, or
    None when the exercise restricts no collective; `collective_rule` says the rule in
    words. `apis`: {dotted name of a forbidden class or function: the rule in words}.
    `on_traffic`: a module-level function (event, rank, world size) -> what is wrong (a
    string, or (api, rule)) or None, judging every call the part's recorder sees
    (exercises/_traffic.py) when it happens."""
    allowed: tuple[str, ...] | None = None
    collective_rule: str = ""
    apis: dict = field(default_factory=dict)
    on_traffic: object = None


class Watch:
    def __init__(self):
        self.broken: list[str] = []

    def trip(self, api: str, rule: str):
        raise RuleBroken(self.note(api, rule))

    def note(self, api: str, rule: str) -> str:
        """Record a broken rule without stopping the code that broke it (the part scores 0
        all the same): what the recorder sees below Python (exercises/_traffic.py) lets
        the call go on, so that a rule broken on one rank never leaves the others waiting."""
        msg = f"{api} was called, which this exercise forbids: {rule}"
        if msg not in self.broken:
            self.broken.append(msg)
        return msg


_STATE = threading.local()  # .exempt: the grader's own oracle is running
_HERE = os.path.dirname(os.path.realpath(__file__))


def _exempt() -> bool:
    return getattr(_STATE, "exempt", False)


def _grader_file(filename: str) -> bool:
    """Is `filename` one of the grader's own files (exercises/checks_NN.py, grade.py or a
    _module.py of exercises/)? The learner's file (exercises/NN_name.py) is not."""
    path = os.path.realpath(filename)
    return (os.path.dirname(path) == _HERE
            and re.fullmatch(r"checks_\d\d\.py|grade\.py|_\w+\.py", os.path.basename(path)) is not None)


def exempt():
    """The grader's own collectives (its oracle) run in here, past the watch. Only the
    grader's files may enter it: called from anywhere else (the learner's code) it trips,
    as a forbidden API does (the file check refuses naming it at all)."""
    caller = sys._getframe(1).f_code.co_filename
    if not _grader_file(caller):
        w = current()[0]
        msg = ("exercises._rules.exempt was called from " + os.path.basename(caller) + ", which "
               "this exercise forbids: the grader's exempt context is the grader's alone")
        if w is not None and msg not in w.broken:
            w.broken.append(msg)
        raise RuleBroken(msg)
    return _exempt_block()


@contextmanager
def _exempt_block():
    before, _STATE.exempt = _exempt(), True
    try:
        yield
    finally:
        _STATE.exempt = before


def resolve(dotted: str):
    """The object a dotted name names (longest importable module prefix, then attributes);
    None when this torch has no such thing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for a in parts[i:]:
                obj = getattr(obj, a)
        except AttributeError:
            return None
        return obj
    return None


def _patch_attr(undo: list, owner, name: str, value) -> None:
    missing = object()
    old = owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(owner, name, missing)
    setattr(owner, name, value)
    undo.append(lambda: delattr(owner, name) if old is missing else setattr(owner, name, old))


def _trip_method(w: Watch, cls, name: str, api: str, rule: str, undo: list) -> None:
    orig = getattr(cls, name)

    def tripwire(self, *args, **kwargs):
        if _exempt():
            return orig(self, *args, **kwargs)
        w.trip(api, rule)
    _patch_attr(undo, cls, name, tripwire)


def _trip_function(w: Watch, dotted: str, f, rule: str, undo: list) -> None:
    """Replace `f` where it lives and, for a plain function, swap its code for one that
    trips, so that references taken before the watch began trip too."""
    module, _, name = dotted.rpartition(".")
    owner = resolve(module)

    def tripwire(*args, **kwargs):
        if _exempt():
            return f(*args, **kwargs)
        w.trip(dotted, rule)
    if owner is not None:
        _patch_attr(undo, owner, name, tripwire)
    if isinstance(f, types.FunctionType):
        same = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        same.__kwdefaults__ = f.__kwdefaults__
        key = f"__exercise_rule_{id(f)}"

        def trip(args, kwargs):
            if _exempt():
                return same(*args, **kwargs)
            w.trip(dotted, rule)
        # the tripwire's code keeps f's number of free variables (a wrapped function's
        # closure: Python requires it), naming them only in a branch that never runs
        free = [f"_v{i}" for i in range(len(f.__code__.co_freevars))]
        body = f"        if {key} is None: ({', '.join(free)},)\n" if free else ""
        ns: dict = {}
        exec(f"def _outer({', '.join(free)}):\n    def _t(*args, **kwargs):\n{body}"
             f"        return {key}(args, kwargs)\n    return _t\n", ns)
        f.__globals__[key], code = trip, f.__code__
        f.__code__ = ns["_outer"](*range(len(free))).__code__

        def restore():
            f.__code__ = code
            f.__globals__.pop(key, None)
        undo.append(restore)


@contextmanager
def watch(rules: Rules | None):
    """While the block runs, what `rules` forbids trips (see the module docstring)."""
    w, undo = Watch(), []
    try:
        if rules is not None and rules.allowed is not None:
            classes = [dist.ProcessGroup] + [c for c in (getattr(dist, "ProcessGroupGloo", None),)
                                             if c is not None]
            for cls in classes:
                for name in COLLECTIVES:
                    if name not in rules.allowed and name in dir(cls):
                        api = _DIST_NAME.get(name, f"ProcessGroup.{name}")
                        _trip_method(w, cls, name, f"{api} (ProcessGroup.{name})",
                                     rules.collective_rule, undo)
            for name in _FUNCTIONAL:
                dotted = f"torch.distributed._functional_collectives.{name}"
                if (f := resolve(dotted)) is not None:
                    _trip_function(w, dotted, f, rules.collective_rule, undo)
        for dotted, rule in (rules.apis if rules is not None else {}).items():
            obj = resolve(dotted)
            if isinstance(obj, type):
                _trip_method(w, obj, "__init__", dotted, rule, undo)
            elif callable(obj):
                _trip_function(w, dotted, obj, rule, undo)
        yield w
    finally:
        for f in reversed(undo):
            f()


def scan(w: Watch | None, rules: Rules | None, *objs) -> None:
    """Trip on any forbidden class found in `objs` or, for modules, anywhere in their tree
    (what a constructor patch cannot see: fully_shard, an object built before the watch)."""
    if w is None or rules is None:
        return
    classes = [(d, c, rule) for d, rule in rules.apis.items() if isinstance(c := resolve(d), type)]
    for obj in objs:
        inside = list(obj.modules()) if hasattr(obj, "modules") else [obj]
        if hasattr(obj, "__dict__"):  # a wrapper holding the module it wraps
            inside += [v for v in vars(obj).values() if hasattr(v, "modules")]
            inside += [m for v in vars(obj).values() if hasattr(v, "modules") for m in v.modules()]
        for m in inside:
            for dotted, cls, rule in classes:
                if isinstance(m, cls):
                    try:
                        w.trip(dotted, rule)
                    except RuleBroken:
                        pass


def defined_in(mod) -> list[str]:
    """Dotted names of everything callable `mod` defines: its functions and classes, and
    the classes' own methods (static and class methods included), so that an object made
    without its constructor trips when used. Enums and exceptions are left out (what they
    do is no implementation)."""
    import enum
    names = []
    for name, obj in vars(mod).items():
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if isinstance(obj, type):
            if issubclass(obj, (enum.Enum, BaseException)):
                continue
            names.append(f"{mod.__name__}.{name}")
            names += [f"{mod.__name__}.{name}.{m}" for m, f in vars(obj).items()
                      if m != "__init__" and isinstance(f, (types.FunctionType, staticmethod, classmethod))]
        elif isinstance(obj, types.FunctionType):
            names.append(f"{mod.__name__}.{name}")
    return names


def current() -> tuple[Watch | None, Rules | None]:
    """The watch and rules of the part running on this rank (set by the harness)."""
    return getattr(_STATE, "watch", None), getattr(_STATE, "rules", None)


@contextmanager
def watching(rules: Rules | None):
    """watch(rules), remembered as current() for parts that scan what they built."""
    with watch(rules) as w:
        before = current()
        _STATE.watch, _STATE.rules = w, rules
        try:
            yield w
        finally:
            _STATE.watch, _STATE.rules = before


@contextmanager
def refusing(rules: Rules, suffix: str = ""):
    """watching(rules) for a check that runs learner code in one process: a broken rule
    fails the check (AssertionError naming it, + `suffix`), even when the learner's code
    caught the RuleBroken; any other exception passes through."""
    with watching(rules) as w:
        try:
            yield w
        except Exception:
            if not w.broken:
                raise
    if w.broken:
        raise AssertionError(w.broken[0] + suffix)


def scan_built(*objs) -> None:
    """scan() with the current part's watch and rules: called by parts on what the
    learner's code built."""
    scan(*current(), *objs)
