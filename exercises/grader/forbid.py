"""The classes and functions an exercise forbids, made to say so when called (rules.py says
whose call counts). A class is judged where it is constructed, a function where it is
called, under any name it was imported by; a module not imported yet is watched from its
import (an import hook), not imported only to be watched (DTensor's costs a second).
"""

import functools
import importlib
import importlib.util
import sys

from exercises.grader import rules


class RuleBroken(RuntimeError):
    """Raised where the code under test called a forbidden class or function: what it
    would have built is the exercise's answer, so nothing after it is worth running."""


def install(targets) -> None:
    for target in targets:
        if target.partition(":")[0] in sys.modules:
            _install(target)
        else:  # when it is imported
            _Later.wanted.setdefault(target.partition(":")[0], set()).add(target)
    if _Later.wanted and _Later not in sys.meta_path:
        sys.meta_path.insert(0, _Later)


class _Later:
    """An import hook: a module with forbidden names, imported after the watch began,
    has them installed as soon as it has run."""
    wanted: dict = {}  # module name -> its targets

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in cls.wanted:
            return None
        sys.meta_path.remove(cls)  # find the module the usual way
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, cls)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module, __run=run, __name=name):
            __run(module)
            for t in cls.wanted.pop(__name, ()):
                _install(t)
        spec.loader.exec_module = exec_module
        return spec


def resolve(target: str):
    """(owner, name) of "module:name" or "module:Class.name" (the grader's way of naming a thing)."""
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name


def _trip(target: str):
    w, where = rules._judged()
    if w is not None and w.rules and target in w.rules.forbidden:
        name = target.replace(":", ".")
        w.note(f"{name} was called", where, w.rules.forbidden[target])
        raise RuleBroken(w.broken[-1])


_DONE: set = set()


def _install(target: str) -> None:
    """Make `target` (a class or function, see Rules) note itself when called in a watch."""
    if target in _DONE:
        return
    owner, name = resolve(target)
    obj = getattr(owner, name)
    if isinstance(obj, type):  # a class: judged where it is constructed, subclasses too
        slot = "__new__" if "__new__" in vars(obj) and "__init__" not in vars(obj) else "__init__"
        raw = vars(obj).get(slot, getattr(obj, slot))
    else:
        raw = vars(owner).get(name, obj) if isinstance(owner, type) else obj
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw

    def call(*a, __fn=fn, **k):
        if rules._CURRENT:
            _trip(target)
        return __fn(*a, **k)
    functools.update_wrapper(call, fn)
    if isinstance(obj, type):
        setattr(obj, slot, staticmethod(call) if isinstance(raw, staticmethod) or slot == "__new__" else call)
    else:
        new = type(raw)(call) if isinstance(raw, (staticmethod, classmethod)) else call
        setattr(owner, name, new)
        if not isinstance(owner, type):  # the same function imported elsewhere, any name
            for mod_name, mod in list(sys.modules.items()):
                if mod_name.split(".")[0] == "torch" and mod is not owner:
                    continue  # torch's own code keeps its own
                space = getattr(mod, "__dict__", None)
                for key, value in list(space.items()) if isinstance(space, dict) else ():
                    if value is obj:
                        space[key] = new
    _DONE.add(target)
