"""The learner's file, read before anything in it runs: what it may not name.

Every exercise's rules are enforced twice. While the learner's code runs, exercises/_rules.py
trips on the forbidden APIs it calls. Before that, this module reads the learner's file as
a syntax tree (nothing is imported or run) and refuses, naming the line and the rule:

- minidist's own modules for the exercise's idea (its checks module's IDEA_MODULES) and the
  REFERENCE targets: the answer is not a building block; and any other part of minidist but
  what the stub itself imports (IDEA_ALLOWED) and minidist.launch, since minidist's modules
  re-export each other's objects (minidist.train holds the scaler and ZeRO);
- anything of `exercises.*`: the grader, its checks, its reference and its exempt context;
- the torch APIs the exercise forbids at run time (its RULES: forbidden classes and
  functions, and the torch.distributed collectives outside its allowed ones), under any
  name: imported, an attribute captured at module level or as a default argument, an
  alias of a module, getattr with a constant string, a star import; a module's attribute
  named by a string built at run time (getattr, vars, __dict__), which cannot be read;
- torch's private or internal APIs (any `_name` under torch, torch.ops);
- reaching code by name at run time, which would make the above unreadable: importlib,
  __import__, sys.modules, exec/eval/compile, the garbage collector, frames and code
  objects (sys._getframe, inspect, __globals__, __code__, ...), ctypes.

`problems(...)` lists the violations; `of_exercise(nn, path)` reads an exercise's rules
from exercises/checks_NN.py. A file with a violation scores 0 on every check, with the
first violation as the message, and none of its code runs.
"""

from __future__ import annotations

import ast
import sys

_BY_NAME = "no modules or objects reached by name at run time"
_FRAMES = "no frames, code objects or other modules' globals reached at run time"
_BY_NAME_HOW = (_BY_NAME + ": an attribute named by a string built at run time (or reached "
                "through vars(), globals() or locals()) cannot be read before it runs; write the name out")
_MODULE_ROOTS = ("torch", "minidist", "exercises", "sys")
_AROUND = "no code run around or below the grader's (operator kernels, modes, extensions, fetched code)"
# The modules a solution may import: torch and minidist (less what the exercise forbids) and
# the standard library's plain tools. Anything else (runpy, pkgutil, pickle, subprocess,
# types, ...) could load or run code by name, which no reading of the file can follow.
IMPORTABLE = {"__future__", "torch", "minidist", "math", "cmath", "functools", "itertools",
              "collections", "contextlib", "dataclasses", "typing", "abc", "enum", "numbers",
              "random", "time", "copy", "heapq", "bisect", "statistics", "operator", "os",
              "shutil", "pathlib", "json", "struct", "zlib", "hashlib", "tempfile", "io",
              "warnings", "string", "textwrap", "datetime", "fractions", "decimal", "array",
              "queue", "threading", "errno", "uuid", "re"}
_NOT_IMPORTABLE = ("a solution imports only torch, minidist and the standard library's plain "
                   f"tools ({', '.join(sorted(IMPORTABLE - {'__future__'}))}): other modules can "
                   "load or run code by name, which the grader cannot read")
# attributes that lead, from any object, to the interpreter's modules or to code by name
_REACH = {"sys", "builtins", "__builtins__", "__import__", "importlib", "runpy", "pkgutil",
          "pickle", "marshal", "gc", "inspect", "ctypes", "__dict__", "__loader__", "__spec__",
          "modules_by_name", "_getframe"}
_MONKEYPATCH = ("no changing another module's functions, classes or data (torch's, minidist's, "
                "the grader's): the grader relies on them as they are")
# What no exercise may name, each with its rule (prefixes of dotted names).
COMMON = {
    "exercises": "the grader, its checks, its reference and its exempt context are not yours to import",
    "importlib": _BY_NAME,
    "__import__": _BY_NAME,
    "sys.modules": _BY_NAME,
    "builtins": _BY_NAME,
    "__builtins__": _BY_NAME,
    "exec": "no code built from strings at run time",
    "eval": "no code built from strings at run time",
    "compile": "no code built from strings at run time",
    "gc": "no objects reached through the garbage collector",
    "inspect": _FRAMES,
    "sys._getframe": _FRAMES,
    "sys.settrace": _FRAMES,
    "sys.setprofile": _FRAMES,
    "threading.settrace": _FRAMES,
    "ctypes": "no memory reached below Python",
    "operator.attrgetter": _BY_NAME,
    "operator.methodcaller": _BY_NAME,
    # torch's ways to run code around or below the grader's: dispatcher kernels, function
    # and dispatch modes, compiled extensions, code fetched or unpacked at run time
    "torch.library": _AROUND,
    "torch.overrides": _AROUND,
    "torch.utils.cpp_extension": _AROUND,
    "torch.hub": _AROUND,
    "torch.package": _AROUND,
    "torch.utils.module_tracker": _AROUND,
    # the rendezvous store and what wraps it: data moved there is moved past every collective
    **{f"torch.distributed.{n}": "no data through the rendezvous store: move it with the collectives the exercise allows"
       for n in ("Store", "TCPStore", "FileStore", "HashStore", "PrefixStore", "rendezvous", "elastic",
                 "launcher", "run")},
    **{f"os.{f}": "no processes started, replaced or signalled: your code runs where the grader puts it"
       for f in ("system", "popen", "fork", "forkpty", "kill", "killpg", "posix_spawn", "posix_spawnp",
                 "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
                 "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp", "spawnvpe")},
    "minidist.run": "the workshop (the launcher's internals, the grader's process pool, the run's flags) is not yours to drive",
}
# attributes that reach another function's code, globals or frames
_INTROSPECTION = {"__globals__", "__code__", "__closure__", "__subclasses__", "__builtins__",
                  "f_globals", "f_locals", "f_back", "f_code", "tb_frame", "gi_frame",
                  "cr_frame", "ag_frame", "co_code", "__wrapped__"}

# torch.distributed's functions, by the ProcessGroup method they end in (exercises/_rules.py
# watches the methods; here they are refused by name).
DIST_FUNCTIONS = {
    "allreduce": ("all_reduce", "all_reduce_coalesced"),
    "allgather": ("all_gather", "all_gather_object"),
    "_allgather_base": ("all_gather_into_tensor", "_all_gather_base"),
    "all_gather_single": ("all_gather_into_tensor", "_all_gather_base"),
    "reduce_scatter": ("reduce_scatter",),
    "_reduce_scatter_base": ("reduce_scatter_tensor", "_reduce_scatter_base"),
    "reduce_scatter_single": ("reduce_scatter_tensor", "_reduce_scatter_base"),
    "alltoall": ("all_to_all",),
    "alltoall_base": ("all_to_all_single",),
    "broadcast": ("broadcast", "broadcast_object_list"),
    "reduce": ("reduce",),
    "gather": ("gather", "gather_object"),
    "scatter": ("scatter", "scatter_object_list"),
}


def forbidden_names(rules=None, idea_modules=(), references=(), extra=None) -> dict:
    """{dotted prefix: the rule in words} for an exercise: COMMON, its idea modules, its
    REFERENCE targets, its RULES (apis and collectives), and `extra`."""
    table = dict(COMMON)
    idea = "this is the exercise's idea, yours to write: minidist's module for it is its answer"
    table.update({m: idea for m in idea_modules})
    table.update({r.replace(":", "."): idea for r in references})
    if rules is not None:
        for dotted, rule in dict(rules.apis.items()).items():
            table.setdefault(dotted, rule)
        if rules.allowed is not None:
            allowed = {f for m in rules.allowed for f in DIST_FUNCTIONS.get(m, ())}
            for method, fns in DIST_FUNCTIONS.items():
                if method not in rules.allowed:
                    for f in fns:
                        if f not in allowed:
                            table.setdefault(f"torch.distributed.{f}", rules.collective_rule)
                            table.setdefault(f"torch.distributed.distributed_c10d.{f}",
                                             rules.collective_rule)
    table.update(extra or {})
    return table


def _forbidden_objects(table: dict) -> list:
    """(object, dotted, rule) for the torch entries already importable without importing
    anything new: an alias under another path (torch.cuda.amp.GradScaler) is the same
    object, or a subclass."""
    out = []
    for dotted, rule in table.items():
        if dotted.split(".")[0] == "torch" and (obj := _loaded(dotted)) is not None:
            if isinstance(obj, type) or callable(obj):
                out.append((obj, dotted, rule))
    return out


def _loaded(dotted: str):
    """The object `dotted` names, walked from modules already imported (never importing)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is None:
            continue
        obj = mod
        try:
            for a in parts[i:]:
                obj = getattr(obj, a)
        except Exception:
            return None
        return obj
    return None


def problems(source: str, filename: str, table: dict, allowed=(), attrs=None) -> list[str]:
    """What in `source` breaks a rule of `table` ({dotted prefix: rule}), each naming its
    line: read, never run. `allowed`: dotted names the stub itself hands out; `attrs`:
    {attribute name: rule}, refused on anything (an exercise's FILE_ATTRS)."""
    attrs = attrs or {}
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as e:
        return [f"{filename} does not load: SyntaxError: line {e.lineno}: {e.msg}"]
    objects = _forbidden_objects(table)
    leaves = {d.rsplit(".", 1)[-1]: (d, r) for d, r in table.items()}
    alias: dict[str, str] = {}
    found: list[str] = []

    def _ok(dotted: str) -> bool:
        return any(dotted == a or dotted.startswith(a + ".") for a in allowed)

    def banned(dotted: str) -> str | None:
        if _ok(dotted):
            return None
        for prefix, rule in table.items():
            if dotted == prefix or dotted.startswith(prefix + "."):
                return f"{prefix}: {rule}"
        parts = dotted.split(".")
        if parts[0] == "minidist" and len(parts) > 1 and parts[1] != "launch":
            return ("minidist is this course's answer key: a solution uses only what the stub "
                    "imports from it" + (f" ({', '.join(a for a in allowed if a.startswith('minidist'))})"
                                         if any(a.startswith("minidist") for a in allowed) else " (nothing, here)"))
        if parts[0] == "torch" and (parts[1:2] == ["ops"] or any(
                p.startswith("_") and not p.startswith("__") for p in parts[1:])):
            return ("torch's private APIs and torch.ops: only torch's public API, which the "
                    "grader watches, is yours to use")
        if parts[0] == "torch":
            obj = _loaded(dotted)
            for bad, name, rule in objects if obj is not None else ():
                if obj is bad or (isinstance(obj, type) and isinstance(bad, type)
                                  and issubclass(obj, bad)):
                    return f"{dotted} is {name}: {rule}"
        return None

    def flag(node, what: str, why: str):
        found.append(f"{filename}, line {node.lineno}: {what} breaks a rule ({why}); "
                     "every check scores 0")

    def dotted_of(node) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            return ".".join([alias.get(node.id, node.id), *reversed(parts)])
        return None

    # imports first (anywhere in the file): they define the aliases
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if why := banned(a.name):
                    flag(node, f"`import {a.name}`", why)
                elif a.name.split(".")[0] not in IMPORTABLE:
                    flag(node, f"`import {a.name}`", _NOT_IMPORTABLE)
        elif isinstance(node, ast.ImportFrom):
            mod = (("exercises" + "." * (node.level - 1)) if node.level else "") + (
                ("." if node.level and node.module else "") + (node.module or ""))
            if not node.level and mod.split(".")[0] not in IMPORTABLE | {"exercises"}:
                flag(node, f"`from {mod} import ...`", _NOT_IMPORTABLE)
            for a in node.names:
                if a.name == "*":
                    inside = [d for d in table if d.startswith(mod + ".")]
                    if why := banned(mod) or (inside and f"{inside[0]}: {table[inside[0]]}"):
                        flag(node, f"`from {mod} import *`", why)
                    continue
                full = f"{mod}.{a.name}"
                alias[a.asname or a.name] = full
                if why := None if _ok(full) else banned(full) or banned(mod):
                    flag(node, f"`from {mod} import {a.name}`", why)
    # simple aliases: m = torch.distributed
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if (d := dotted_of(node.value)) is not None and d.split(".")[0] in ("torch", "minidist", "exercises"):
                alias.setdefault(node.targets[0].id, d)
    def root_of(node):  # the name an attribute or subscript chain starts from
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def patched(target) -> bool:  # a target inside something imported (torch.x = ..., dist.f = ...)
        if not isinstance(target, (ast.Attribute, ast.Subscript)) or root_of(target) not in alias:
            return False
        d = dotted_of(target.value if isinstance(target, ast.Subscript) else target) or ""
        return not d.startswith(("torch.backends", "os.environ"))

    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            for leaf in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                if patched(leaf):
                    flag(node, f"`{ast.unparse(leaf)} = ...`", _MONKEYPATCH)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and root_of(node.args[0]) in alias):
            flag(node, f"`{ast.unparse(node)}`", _MONKEYPATCH)
        if isinstance(node, ast.Attribute):
            if node.attr in attrs:
                flag(node, f"`{ast.unparse(node)}`", attrs[node.attr])
            elif node.attr in _REACH:
                flag(node, f"`{ast.unparse(node)}`", _BY_NAME)
            elif node.attr in _INTROSPECTION:
                flag(node, f"`{ast.unparse(node)}`", _FRAMES)
            elif (d := dotted_of(node)) is not None and (why := banned(d)):
                flag(node, f"`{ast.unparse(node)}`", why)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            d = alias.get(node.id, node.id)
            if (node.id in alias or node.id in COMMON) and (why := banned(d)):
                flag(node, f"`{node.id}`" + (f" ({d})" if d != node.id else ""), why)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1:
            name = node.args[1]
            base = dotted_of(node.args[0])
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                # a name computed at run time cannot be read here: refused, on anything
                flag(node, f"`{ast.unparse(node)}`", _BY_NAME_HOW)
                continue
            if name.value in _INTROSPECTION or name.value in _REACH:
                flag(node, f"`{ast.unparse(node)}`", _FRAMES if name.value in _INTROSPECTION else _BY_NAME)
            elif base is not None and base.split(".")[0] in ("torch", "minidist", "exercises", "sys"):
                if why := banned(f"{base}.{name.value}"):
                    flag(node, f"`{ast.unparse(node)}`", why)
            elif name.value in leaves:
                d, rule = leaves[name.value]
                flag(node, f"`{ast.unparse(node)}`", f"{d}: {rule}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("vars", "globals", "locals", "breakpoint")):
            flag(node, f"`{ast.unparse(node)}`", _BY_NAME_HOW)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
            if isinstance(key, str) and key in leaves and "." not in key and key not in ("exercises",):
                d, rule = leaves[key]
                flag(node, f"`{ast.unparse(node)}`", f"{d}: {rule}")
    # in the order of the file, each once
    found = list(dict.fromkeys(found))
    found.sort(key=lambda m: int(m.split(", line ", 1)[1].split(":", 1)[0]) if ", line " in m else 0)
    return found


def of_exercise(nn: str, path, checks_module=None, reference_targets=()) -> list[str]:
    """problems() of the learner's file `path` for exercise `nn`, with the rules its
    checks module declares: RULES (and LEARNER_RULES where it has a separate one),
    IDEA_MODULES, IDEA_ALLOWED and FILE_RULES."""
    from pathlib import Path
    mod = checks_module
    rules = getattr(mod, "LEARNER_RULES", None) or getattr(mod, "RULES", None)
    table = forbidden_names(rules, getattr(mod, "IDEA_MODULES", ()), reference_targets,
                            getattr(mod, "FILE_RULES", None))
    path = Path(path)
    try:
        source = path.read_text()
    except OSError as e:
        return [f"exercises/{path.name} does not load: {type(e).__name__}: {e}"]
    return problems(source, f"exercises/{path.name}", table, getattr(mod, "IDEA_ALLOWED", ()),
                    getattr(mod, "FILE_ATTRS", None))
