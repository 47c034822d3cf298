"""Graded checks of exercise 10 (exercises/10_tensor_parallel.py), registered with exercises.grade.

Everything runs where it must: in 2 and 3 processes of minidist.run.pool's shared pools, one
call per world size for every part (see exercises/_harness.py), each part on a process
group of its own that the grader makes and hands to the learner's code. The oracle is the
full layer or MLP (plain torch, no communication), built on every rank from the same seed
and computed there alongside: each rank can regenerate every other rank's inputs, so the
sums over ranks are computed without a collective.

While the learner's code runs the grader records, per phase (forward, backward), every
collective and point-to-point call, below torch.distributed's Python where every road to
gloo meets (exercises/_traffic.py), with its kind, its size in elements and whether it
ran on the group given; a group's backend object called directly, a group of the
learner's own or the store scores the part 0. It
also counts the matrix-multiply FLOPs of the MLP at torch's dispatcher, on every thread
(exercises/_traffic.py), so work that only looks split (every rank computing the whole
layer) shows; and f's backward and g's forward must carry this rank's share of the sum in
their recorded all-reduces, so a sum moved any other way does not count.

The rules are enforced twice (see LEARNER_RULES below):
- before anything runs, the learner's file is read (its syntax tree): an import of
  minidist's tensor-parallel modules, of torch's DTensor or autograd-aware collectives, of
  the grader, or reaching modules by name at run time fails every check, naming the line;
- while it runs, exercises/_rules.py's tripwires: torch's DTensor / parallelize_module
  and styles, torch.distributed.nn.functional (its functions and its autograd Functions'
  forward), the functional collectives, collectives other than all-reduce, all-gather and
  reduce-scatter, and every function and class of minidist.tensor_parallel and
  minidist.tensor_parallel.gpt. The last are lifted only for the reference adapters below,
  recognised by identity, which learner code cannot reach without importing this module
  (the file check forbids it).
"""

from __future__ import annotations

import datetime
import functools
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as _dist_nn_functional
import torch.nn as nn
import torch.nn.functional as F

import minidist.tensor_parallel.layers as _tp
import minidist.tensor_parallel.gpt as _tp_gpt
from exercises import _harness as H
from exercises import _traffic
from exercises import _rules
from exercises.grade import check

WORLD_SIZES = (2, 3)
TIMEOUT_S = 20.0  # a rank that waits this long for the others is hung; tests lower it
B, T, C, HID = 2, 6, 8, 12  # T and HID divide over 2 and 3 ranks
P_DROP, SEED = 0.5, 1234
RTOL = ATOL = 1e-5  # fp32, values of order 1, sums of at most HID products reordered
HANG_HINT = ("Every rank must call the same collectives in the same order, with the same "
             "sizes, on the group it is given.")
LEARNER_FILE = Path(__file__).resolve().parent / "10_tensor_parallel.py"

# --------------------------------------------------------------------- the rules

_NO_TORCH_TP = ("exercise 10 writes the communication of tensor parallelism itself, with "
                "torch.distributed's collectives: no DTensor, parallelize_module or its "
                "styles, no torch.distributed.nn.functional")
_NO_MINIDIST = ("exercise 10 is yours to write: minidist.tensor_parallel and "
                "minidist.tensor_parallel.gpt are its answer, not building blocks")
_ALLOWED = ("allreduce", "allgather", "_allgather_base", "all_gather_single",
            "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single")


class _IfImported(dict):
    """Rules.apis whose DTensor entries count once their module is imported. Importing
    DTensor takes seconds per process, so it is not imported only to be watched: an entry
    whose module is not loaded when a part starts is guarded by _forbidden_imports
    instead, which trips on importing it during the part."""

    def items(self):
        return [(k, v) for k, v in super().items()
                if k not in _MODULE_OF or _MODULE_OF[k] in sys.modules]


_DTENSOR = "torch.distributed.tensor"
_MODULE_OF = {f"{_DTENSOR}.{n}": _DTENSOR
              for n in ("DTensor", "DTensor.from_local", "distribute_tensor", "distribute_module")}
_MODULE_OF.update({f"{_DTENSOR}.parallel.{n}": f"{_DTENSOR}.parallel" for n in (
    "parallelize_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "loss_parallel")})


def _torch_apis() -> dict:
    apis = _IfImported({k: _NO_TORCH_TP for k in _MODULE_OF})
    apis.update(_module_apis(_dist_nn_functional, _NO_TORCH_TP))
    return apis


class _ForbiddenImports:
    """A meta-path finder, first in line during a part: importing DTensor trips the rule
    (recorded on the part's watch, as a tripwire would)."""

    def find_spec(self, name, path=None, target=None):
        w, rules = _rules.current()
        if w is not None and (name == _DTENSOR or name.startswith(_DTENSOR + ".")):
            w.trip(f"import {name}", _NO_TORCH_TP)
        return None


def _guarded(part):
    """The part with _ForbiddenImports in place."""
    @functools.wraps(part)
    def run(fns, r, n):
        finder = _ForbiddenImports()
        sys.meta_path.insert(0, finder)
        try:
            return part(fns, r, n)
        finally:
            sys.meta_path.remove(finder)
    return run


def _module_apis(mod, rule: str) -> dict:
    """Every function and class a module defines, as _rules.Rules.apis entries; for an
    autograd Function its forward and backward (apply builds no instance to trip on)."""
    apis = {}
    for name, obj in vars(mod).items():
        if getattr(obj, "__module__", None) != mod.__name__ or not callable(obj):
            continue
        dotted = f"{mod.__name__}.{name}"
        if isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
            apis.update({f"{dotted}.forward": rule, f"{dotted}.backward": rule})
        else:
            apis[dotted] = rule
    return apis


_COLLECTIVE_RULE = ("exercise 10 moves data with all-reduce, all-gather and reduce-scatter "
                    "(torch.distributed's forms, on the group given) only")
# The learner's rules, watched in every part on the ranks.
LEARNER_RULES = _rules.Rules(allowed=_ALLOWED, collective_rule=_COLLECTIVE_RULE,
                             apis=_IfImported({**_torch_apis(), **_module_apis(_tp, _NO_MINIDIST),
                                               **_module_apis(_tp_gpt, _NO_MINIDIST)}))
# minidist's own implementation, graded through the adapters below, is watched for these.
REFERENCE_RULES = _rules.Rules(allowed=_ALLOWED, collective_rule=_COLLECTIVE_RULE,
                               apis=_torch_apis())
# What grade.py watches around each check in this process, where no learner code runs
# (the parts run on the ranks). Not minidist's modules: patched here, a learner's alias of
# one of their functions would be shipped to the ranks as a copy carrying this process's
# tripwire, and would trip there outside the part's watch (as a crash, not a rule).
# minidist's modules for this exercise's idea: the learner's file may not name them
# (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.tensor_parallel", "minidist.tensor_parallel.gpt", "minidist.tensor_parallel.cost", "minidist.compose.tp_muon")
RULES = REFERENCE_RULES

# What the learner's file may not name besides the shared rules (exercises/_filecheck.py:
# IDEA_MODULES above, the grader, torch's private APIs, reaching modules by name, ...).
FILE_RULES = {
    "torch.distributed.tensor": _NO_TORCH_TP,
    "torch.distributed.nn": _NO_TORCH_TP,
    "torch.distributed._functional_collectives": _NO_TORCH_TP,
}


def file_problems(source: str, filename: str = "exercises/10_tensor_parallel.py") -> list[str]:
    """What in the learner's file breaks a rule, each with its line: read, never run
    (exercises/_filecheck.py, with this exercise's rules)."""
    from exercises import _filecheck
    table = _filecheck.forbidden_names(LEARNER_RULES, IDEA_MODULES, (), FILE_RULES)
    return _filecheck.problems(source, filename, table)


def _check_file(impl) -> None:
    """Fail the check when the learner's file breaks a rule (read, before anything runs)."""
    problems = file_problems(LEARNER_FILE.read_text())
    if problems:
        raise AssertionError(problems[0])


# --------------------------------------------------------------------- reference adapters
# minidist's implementation with this exercise's signatures. The runtime rules against
# minidist's modules are lifted for exactly these objects (see _trusted).

def reference_copy_to_region(x, group):
    return _tp.copy_to_region(x, group)


def reference_reduce_from_region(x, group):
    return _tp.reduce_from_region(x, group)


def reference_column_parallel_linear(full, group):
    return _tp.ColumnParallelLinear(full, group)


def reference_row_parallel_linear(full, group):
    return _tp.RowParallelLinear(full, group)


def reference_parallel_mlp(full, group):
    return _tp_gpt.ParallelMLP(full, group)


def reference_sequence_parallel_mlp(x, w_fc, w_proj, group, p=0.0):
    """The two bugs fixed: the gather's backward is a reduce-scatter alone (the all-reduce
    before it summed the gradient a second time: t times too large, and 3x the bytes), and
    the dropout on this rank's positions draws from a stream of this rank's own, forked
    from the default one (tp_rng), which it leaves in step on every rank."""
    h = _tp.gather_sequence(x, group)
    y = _tp.reduce_scatter_sequence(F.linear(F.gelu(F.linear(h, w_fc), approximate="tanh"), w_proj), group)
    if p > 0:
        with _tp.tp_rng(group, x.device):
            y = F.dropout(y, p, training=True)
    return x + y


NAMES = ("copy_to_region", "reduce_from_region", "ColumnParallelLinear", "RowParallelLinear",
         "ParallelMLP", "sequence_parallel_mlp")
_REFERENCES = (reference_copy_to_region, reference_reduce_from_region,
               reference_column_parallel_linear, reference_row_parallel_linear,
               reference_parallel_mlp, reference_sequence_parallel_mlp)


def _trusted(impl) -> bool:
    return all(getattr(impl, n) is f for n, f in zip(NAMES, _REFERENCES))


# --------------------------------------------------------------------- recording

_KIND = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
         **{m: "all_gather" for m in ("allgather", "_allgather_base", "all_gather_single",
                                      "allgather_coalesced", "allgather_into_tensor_coalesced",
                                      "all_gather_single_coalesced")},
         **{m: "reduce_scatter" for m in ("reduce_scatter", "_reduce_scatter_base",
                                          "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
                                          "reduce_scatter_single_coalesced")}}


def _numel(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, (list, tuple)):
        return sum(_numel(o) for o in obj)
    return 0


class _Recorder:
    """Every call that moves data through a process group from Python, per phase:
    (kind, elements, on the group given). Elements: the larger side (an all-gather's
    output, a reduce-scatter's input, an all-reduce's tensor)."""

    def __init__(self, group):
        self.group, self.events, self.phase = group, {}, None
        self.mine = {id(group), id(group._get_backend(torch.device("cpu")))}
        self.sent = {}  # phase -> copies of what this rank's all-reduces carried

    def _seen(self, pg, name, args):
        if self.phase is not None:
            size = max([_numel(a) for a in args[:2]] + [0])
            self.events[self.phase].append((_KIND.get(name, name), size, id(pg) in self.mine))
            if _KIND.get(name) == "all_reduce":
                self.sent[self.phase] += [t.detach().clone() for t in args[0] if isinstance(t, torch.Tensor)]

    def carried(self, phase: str, want: torch.Tensor) -> bool:
        """Did an all-reduce of `phase` carry `want` (this rank's share of the sum), bit for bit?"""
        return any(t.shape == want.shape and torch.equal(t, want) for t in self.sent.get(phase, []))

    def carried_close(self, phase: str, wants: list) -> bool:
        """Did an all-reduce of `phase` carry one of `wants` (this rank's share of a sum that
        the learner's own products made), to fp32 rounding?"""
        return any(_close(t, w) for t in self.sent.get(phase, []) for w in wants)

    def recording(self):
        return H.watching_process_groups(self._seen, (*_rules.COLLECTIVES, "send", "recv", "recv_anysource"))

    @contextmanager
    def __call__(self, phase: str):
        self.events.setdefault(phase, [])
        self.sent.setdefault(phase, [])
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None


# --------------------------------------------------------------------- oracles and helpers

class FullMLP(nn.Module):
    """The oracle: minidist.model.MLP's computation, written out here."""

    def __init__(self, c: int = C, h: int = HID, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(c, h, bias=bias)
        self.c_proj = nn.Linear(h, c, bias=bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


def _block(n_total: int, r: int, n: int) -> slice:
    size = n_total // n
    return slice(r * size, (r + 1) * size)


def _randn(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _group(n: int):
    with _rules.exempt():  # the grader's group: the recorder hands it out to the learner's code
        return dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _close(got, want) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and bool(((got.detach() - want).abs() <= ATOL + RTOL * want.abs()).all()))


def _differ(what: str, got, want, guesses=()) -> str | None:
    """None when got equals want to fp32 rounding, else what is wrong (with the first
    guess (label, alternative) that got matches)."""
    if got is None:
        return f"{what} is None"
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}, want a tensor"
    if got.shape != want.shape:
        return f"{what} has shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if _close(got, want):
        return None
    for label, alt in guesses:
        if alt is not None and alt.shape == want.shape and _close(got, alt):
            return f"{what} differs from the full computation's: it is {label}"
    i = int((got.detach() - want).abs().argmax())
    return (f"{what} differs from the full computation's: element {i} is "
            f"{got.detach().reshape(-1)[i].item():.6g}, want {want.reshape(-1)[i].item():.6g}")


def _params_problem(what: str, module, want: dict) -> str | None:
    """The module holds exactly `want` ({name: tensor or None}) as its parameters."""
    if not isinstance(module, nn.Module):
        return f"{what} is a {type(module).__name__}, want an nn.Module"
    for name, w in want.items():
        p = getattr(module, name, "missing")
        if w is None:
            if p is not None:
                return f"{what}.{name} should be None (the full layer has none)"
            continue
        if not isinstance(p, nn.Parameter):
            return f"{what}.{name} is {type(p).__name__ if p != 'missing' else 'missing'}, want an nn.Parameter"
        if p.shape != w.shape or not torch.equal(p.detach(), w):
            return (f"{what}.{name} has shape {tuple(p.shape)} and is not this rank's slice of "
                    f"the full layer's, shape {tuple(w.shape)}: rank r of t holds the r-th "
                    "contiguous block of 1/t")
    held = sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers())
    expected = sum(w.numel() for w in want.values() if w is not None)
    if held != expected:
        return (f"{what} holds {held} elements in parameters and buffers, its slice is "
                f"{expected}: hold this rank's slice only")
    return None


def _first(*problems):
    return next((p for p in problems if p), None)


# --------------------------------------------------------------------- the parts, run on every rank

_NOT_CARRIED = ("{} summed over the ranks, but none of its all-reduces on the group carried this "
                "rank's {} (the grader records what each all-reduce carries, below "
                "torch.distributed's Python): the sum must travel in them, not another way")


def _fg_part(fns: dict, r: int, n: int) -> dict:
    group = _group(n)
    rec = _Recorder(group)
    out = {"problem": None, "events": rec.events}
    shape = (B, T, C)
    xs = [_randn(100 + k, *shape) for k in range(n)]   # each rank's own x ...
    gys = [_randn(200 + k, *shape) for k in range(n)]  # ... and upstream gradient
    f, g = fns["copy_to_region"], fns["reduce_from_region"]
    with rec.recording():
        # f, with a residual branch that uses the same x: x.grad = gy + sum over ranks of gy
        x = xs[r].clone().requires_grad_()
        with rec("f forward"):
            y = f(x, group)
        if not (isinstance(y, torch.Tensor) and torch.equal(y.detach(), xs[r])):
            out["problem"] = "copy_to_region(x) forward must return x's values unchanged"
            return out
        with rec("f backward"):
            (x + y).backward(gys[r])
        total = torch.stack(gys).sum(0)
        out["problem"] = _differ("after (x + copy_to_region(x)).backward(gy), x.grad", x.grad,
                                 gys[r] + total,
                                 [("gy + gy: f's backward passed this rank's gradient on, not the "
                                   "sum over the group's ranks", 2 * gys[r]),
                                  ("(sum over ranks) twice: the gradient tensor autograd hands "
                                   "f's backward is shared with the residual branch; reduce a "
                                   "copy, not it in place", 2 * total)])
        if out["problem"]:
            return out
        if n > 1 and not rec.carried("f backward", gys[r]):
            out["problem"] = _NOT_CARRIED.format("copy_to_region's backward", "gradient")
            return out
        # g: the sum forward, input untouched; the gradient passed back as it is
        x = xs[r].clone().requires_grad_()
        with rec("g forward"):
            s = g(x, group)
        out["problem"] = _first(
            _differ("reduce_from_region(x)", s, torch.stack(xs).sum(0),
                    [("x itself: forward did not sum over the group's ranks", xs[r])]),
            None if torch.equal(x.detach(), xs[r]) else
            "reduce_from_region(x) changed x: reduce a copy (x may be needed elsewhere)")
        if out["problem"]:
            return out
        if n > 1 and not rec.carried("g forward", xs[r]):
            out["problem"] = _NOT_CARRIED.format("reduce_from_region's forward", "input")
            return out
        with rec("g backward"):
            s.backward(gys[r])
        if x.grad is None or not torch.equal(x.grad, gys[r]):
            out["problem"] = _differ("after reduce_from_region(x).backward(gy), x.grad", x.grad, gys[r],
                                     [("the sum over ranks of gy: g's backward is the identity",
                                       torch.stack(gys).sum(0))]) or \
                "reduce_from_region's backward must pass the gradient on exactly, unchanged"
    return out


def _column_part(fns: dict, r: int, n: int) -> dict:
    group = _group(n)
    rec = _Recorder(group)
    out = {"problem": None, "events": rec.events}
    rows = _block(HID, r, n)
    with rec.recording():
        for bias in (True, False):
            torch.manual_seed(1)
            full = nn.Linear(C, HID, bias=bias)  # the same on every rank
            layer = fns["ColumnParallelLinear"](full, group)
            where = f"ColumnParallelLinear(nn.Linear({C}, {HID}, bias={bias}))"
            want_p = {"weight": full.weight.detach()[rows],
                      "bias": full.bias.detach()[rows] if bias else None}
            if (p := _params_problem(where, layer, want_p)):
                out["problem"] = p
                return out
            x0, gy = _randn(300, B, T, C), _randn(301, B, T, HID)
            xo = x0.clone().requires_grad_()
            full(xo).backward(gy)
            x = x0.clone().requires_grad_()
            with rec(f"column forward bias={bias}"):
                y = layer(x)
            if (p := _differ(f"{where}(x) (this rank's outputs, {rows.start}:{rows.stop})", y,
                             full(x0).detach()[..., rows])):
                out["problem"] = p
                return out
            with rec(f"column backward bias={bias}"):
                y.backward(gy[..., rows])
            local = gy[..., rows] @ full.weight.detach()[rows]
            out["problem"] = _first(
                _differ(f"{where}: x.grad", x.grad, xo.grad,
                        [("this rank's partial sum only: the input is used by every rank's "
                          "slice, so its gradient is the sum over the group's ranks", local)]),
                _differ(f"{where}: weight.grad", layer.weight.grad, full.weight.grad[rows]),
                _differ(f"{where}: bias.grad", layer.bias.grad, full.bias.grad[rows]) if bias else None)
            if out["problem"]:
                return out
    return out


def _row_part(fns: dict, r: int, n: int) -> dict:
    group = _group(n)
    rec = _Recorder(group)
    out = {"problem": None, "events": rec.events}
    cols = _block(HID, r, n)
    with rec.recording():
        for bias in (True, False):
            torch.manual_seed(2)
            full = nn.Linear(HID, C, bias=bias)
            with torch.no_grad():
                if bias:
                    full.bias.add_(0.5)  # a bias large enough to see counted twice
            layer = fns["RowParallelLinear"](full, group)
            where = f"RowParallelLinear(nn.Linear({HID}, {C}, bias={bias}))"
            want_p = {"weight": full.weight.detach()[:, cols],
                      "bias": full.bias.detach() if bias else None}
            if (p := _params_problem(where, layer, want_p)):
                out["problem"] = p
                return out
            x0, gy = _randn(400, B, T, HID), _randn(401, B, T, C)
            xo = x0.clone().requires_grad_()
            want = full(xo)
            want.backward(gy)
            x = x0[..., cols].clone().requires_grad_()
            with rec(f"row forward bias={bias}"):
                y = layer(x)
            guesses = []
            if bias:
                guesses.append((f"the full output plus {n - 1} more copies of the bias: it was "
                                "added on every rank before the sum; add it once, after",
                                want.detach() + (n - 1) * full.bias.detach()))
                guesses.append(("the full output without its bias", want.detach() - full.bias.detach()))
            part = x0[..., cols] @ full.weight.detach()[:, cols].T
            guesses.append(("this rank's partial sum: the partial sums of the ranks meet in one "
                            "sum over the group", part))
            if (p := _differ(f"{where}(x) (x: this rank's input features {cols.start}:{cols.stop})",
                             y, want.detach(), guesses)):
                out["problem"] = p
                return out
            with rec(f"row backward bias={bias}"):
                y.backward(gy)
            out["problem"] = _first(
                _differ(f"{where}: x.grad", x.grad, xo.grad[..., cols],
                        [(f"{n} times too large: the output's gradient is the same on every "
                          "rank already; g's backward passes it on as it is", n * xo.grad[..., cols])]),
                _differ(f"{where}: weight.grad", layer.weight.grad, full.weight.grad[:, cols]),
                _differ(f"{where}: bias.grad", layer.bias.grad, full.bias.grad) if bias else None)
            if out["problem"]:
                return out
    return out


def _flops(fn) -> int:
    """FLOPs of the matrix multiplies that reach aten while fn runs (what F.linear, @,
    torch.mm, einsum and bmm become below autograd), 2 per multiply-add, on every thread:
    counted at torch's dispatcher (exercises/_traffic.py), where no learner code can step
    around the count."""
    with _traffic.counting_matmuls() as mm:
        fn()
    return sum(f for _, _, f in mm)


def _mlp_part(fns: dict, r: int, n: int) -> dict:
    group = _group(n)
    rec = _Recorder(group)
    out = {"problem": None, "events": rec.events, "flops": None, "carried": (False, False)}
    hid = _block(HID, r, n)
    torch.manual_seed(3)
    full = FullMLP()
    x0, gy = _randn(500, B, T, C), _randn(501, B, T, C)
    xo = x0.clone().requires_grad_()
    box = {}
    full_fwd = _flops(lambda: box.update(y=full(xo)))
    want = box["y"]
    full_bwd = _flops(lambda: want.backward(gy))
    with rec.recording():
        mlp = fns["ParallelMLP"](full, group)
        for name, want_p in (("c_fc", {"weight": full.c_fc.weight.detach()[hid],
                                       "bias": full.c_fc.bias.detach()[hid]}),
                             ("c_proj", {"weight": full.c_proj.weight.detach()[:, hid],
                                         "bias": full.c_proj.bias.detach()})):
            if (p := _params_problem(f"ParallelMLP(full).{name}", getattr(mlp, name, None), want_p)):
                out["problem"] = p
                return out
        x = x0.clone().requires_grad_()
        with rec("mlp forward"):
            fwd = _flops(lambda: box.update(y=mlp(x)))
        y = box["y"]
        wrong_output = _differ("ParallelMLP(full)(x)", y, want.detach())
        if not (isinstance(y, torch.Tensor) and y.shape == want.shape and y.requires_grad):
            out["problem"] = wrong_output or "ParallelMLP(full)(x) does not require grad"
            return out
        with rec("mlp backward"):  # run even when the output is wrong: the communication
            bwd = _flops(lambda: y.backward(gy))  # check reads what it moved
    out["flops"] = (fwd, bwd, full_fwd, full_bwd)
    # what this rank's slice of the hidden layer contributes, forward (the output, before
    # c_proj's bias, which may be added before the sum, on one rank or as bias/t on each)
    # and backward (the input gradient): the all-reduces must carry these
    xs = x0.clone().requires_grad_()
    part = F.linear(F.gelu(F.linear(xs, full.c_fc.weight.detach()[hid], full.c_fc.bias.detach()[hid]),
                           approximate="tanh"), full.c_proj.weight.detach()[:, hid])
    part.backward(gy)
    b = full.c_proj.bias.detach()
    out["carried"] = (rec.carried_close("mlp forward", [part.detach(), part.detach() + b, part.detach() + b / n]),
                      rec.carried_close("mlp backward", [xs.grad]))
    out["problem"] = _first(
        wrong_output,
        _differ("ParallelMLP: x.grad", x.grad, xo.grad),
        _differ("ParallelMLP: c_fc.weight.grad", mlp.c_fc.weight.grad, full.c_fc.weight.grad[hid]),
        _differ("ParallelMLP: c_fc.bias.grad", mlp.c_fc.bias.grad, full.c_fc.bias.grad[hid]),
        _differ("ParallelMLP: c_proj.weight.grad", mlp.c_proj.weight.grad, full.c_proj.weight.grad[:, hid]),
        _differ("ParallelMLP: c_proj.bias.grad", mlp.c_proj.bias.grad, full.c_proj.bias.grad))
    return out


def _sp_setup(r: int, n: int):
    pos, hid = _block(T, r, n), _block(HID, r, n)
    x_full, w_fc, w_proj = _randn(600, B, T, C), _randn(601, HID, C) * 0.5, _randn(602, C, HID) * 0.5
    mlp_out = lambda x, a, b: F.linear(F.gelu(F.linear(x, a), approximate="tanh"), b)  # noqa: E731
    return pos, hid, x_full, w_fc, w_proj, mlp_out


def _sp_grad_part(fns: dict, r: int, n: int) -> dict:
    group = _group(n)
    rec = _Recorder(group)
    out = {"problem": None, "events": rec.events}
    pos, hid, x_full, w_fc, w_proj, mlp_out = _sp_setup(r, n)
    gy = _randn(603, B, T, C)
    xo, ao, bo = (t.clone().requires_grad_() for t in (x_full, w_fc, w_proj))
    want = xo + mlp_out(xo, ao, bo)
    want.backward(gy)
    x = x_full[:, pos].clone().requires_grad_()
    a, b = w_fc[hid].clone().requires_grad_(), w_proj[:, hid].clone().requires_grad_()
    with rec.recording():
        with rec("sp forward"):
            y = fns["sequence_parallel_mlp"](x, a, b, group, 0.0)
        if (p := _differ("sequence_parallel_mlp(x, w_fc, w_proj, group, p=0) (this rank's "
                         "positions)", y, want.detach()[:, pos])):
            out["problem"] = p
            return out
        with rec("sp backward"):
            y.backward(gy[:, pos])
    too_big = lambda g: None if g is None else [(f"{n} times too large: the gradient was summed "  # noqa: E731
                                                 "over the ranks twice", n * g)]
    out["problem"] = _first(
        _differ("x.grad", x.grad, xo.grad[:, pos]),
        _differ("w_fc.grad", a.grad, ao.grad[hid], too_big(ao.grad[hid])),
        _differ("w_proj.grad", b.grad, bo.grad[:, hid], too_big(bo.grad[:, hid])))
    if out["problem"] and x.grad is not None and _close(x.grad - gy[:, pos], n * (xo.grad[:, pos] - gy[:, pos])):
        out["problem"] = ("x.grad differs from the full block's: its MLP branch is "
                          f"{n} times too large, summed over the ranks twice")
    return out


def _sp_dropout_part(fns: dict, r: int, n: int) -> dict:
    group = _group(n)
    pos, hid, x_full, w_fc, w_proj, mlp_out = _sp_setup(r, n)
    x, a, b = x_full[:, pos], w_fc[hid], w_proj[:, hid]
    branch = mlp_out(x_full, w_fc, w_proj)[:, pos] / (1 - P_DROP)  # a kept element's value
    fn = fns["sequence_parallel_mlp"]
    out = {"problem": None, "masks": [], "stream": None}
    torch.manual_seed(SEED)  # the default stream, seeded alike on every rank
    with torch.no_grad():
        for call in range(3):
            if call == 2:
                torch.manual_seed(SEED)  # the same state again: the same masks
            y = fn(x, a, b, group, P_DROP)
            if call == 0:
                out["stream"] = torch.rand(4).tolist()
            d = y - x
            kept = (d - branch).abs() <= ATOL + RTOL * branch.abs()
            dropped = d.abs() <= ATOL
            if not bool((kept | dropped).all()):
                out["problem"] = (f"sequence_parallel_mlp(..., p={P_DROP}): some elements of the "
                                  "MLP branch are neither dropped (0) nor kept and scaled by "
                                  "1/(1-p): the output is not x + dropout(the full MLP's)")
                return out
            out["masks"].append(kept.flatten().tolist())
    return out


PARTS = {name: _guarded(part) for name, part in (
    ("fg", _fg_part), ("column", _column_part), ("row", _row_part), ("mlp", _mlp_part),
    ("sp_grad", _sp_grad_part), ("sp_dropout", _sp_dropout_part))}

_CACHE = H.Cache()


def _results(impl) -> dict:
    fns = {n: getattr(impl, n) for n in NAMES}
    rules = REFERENCE_RULES if _trusted(impl) else LEARNER_RULES
    key = (*fns.values(), WORLD_SIZES, TIMEOUT_S)  # tests change the last two
    return _CACHE.get(key, lambda: H.run_all(PARTS, fns, WORLD_SIZES, TIMEOUT_S, HANG_HINT, rules))


def _part(impl, name):
    _check_file(impl)
    return H.per_world_size(_results(impl), name, WORLD_SIZES)


# --------------------------------------------------------------------- the checks

@check("10", points=2, name="f and g: forward values and the gradients they pass back")
def _fg(impl):
    for _, per_rank in _part(impl, "fg"):
        H.first_problem(res["problem"] for res in per_rank)


@check("10", points=2, name="ColumnParallelLinear: its rows of W and b, output, weight/bias/input gradients")
def _column(impl):
    for _, per_rank in _part(impl, "column"):
        H.first_problem(res["problem"] for res in per_rank)


@check("10", points=2, name="RowParallelLinear: its columns of W, the bias once, output and gradients")
def _row(impl):
    for _, per_rank in _part(impl, "row"):
        H.first_problem(res["problem"] for res in per_rank)


@check("10", points=2, name="ParallelMLP == the full MLP: output, input gradient, every shard's gradient")
def _mlp(impl):
    for _, per_rank in _part(impl, "mlp"):
        H.first_problem(res["problem"] for res in per_rank)


def _events_problem(where: str, got: list, want: list) -> str | None:
    if any(not on_group for _, _, on_group in got):
        return (f"{where}: a collective ran on another process group than the one given "
                "(pass group=group to every call)")
    shown = [(k, s) for k, s, _ in got]
    if shown != want:
        return (f"{where}: moved {shown or 'nothing'} (kind, elements); want "
                f"{want or 'nothing'}")
    return None


@check("10", points=2, name="communication and work: one all-reduce each way per column+row pair, 1/t of the FLOPs")
def _communication(impl):
    numel = B * T * C
    for n, per_rank in _part(impl, "fg"):
        for r, res in enumerate(per_rank):
            ev = res["events"]
            H.first_problem(_events_problem(f"on {n} ranks, rank {r}, {phase}", ev.get(phase, []), want)
                            for phase, want in (("f forward", []), ("f backward", [("all_reduce", numel)]),
                                                ("g forward", [("all_reduce", numel)]), ("g backward", [])))
    for n, per_rank in _part(impl, "column"):
        for r, res in enumerate(per_rank):
            ev = res["events"]
            H.first_problem(_events_problem(f"on {n} ranks, rank {r}, ColumnParallelLinear {ph}",
                                            ev.get(ph, []), want)
                            for ph, want in (("column forward bias=True", []),
                                             ("column backward bias=True", [("all_reduce", numel)])))
    for n, per_rank in _part(impl, "row"):
        for r, res in enumerate(per_rank):
            ev = res["events"]
            H.first_problem(_events_problem(f"on {n} ranks, rank {r}, RowParallelLinear {ph}",
                                            ev.get(ph, []), want)
                            for ph, want in (("row forward bias=True", [("all_reduce", numel)]),
                                             ("row backward bias=True", [])))
    for n, per_rank in _part(impl, "mlp"):
        for r, res in enumerate(per_rank):
            ev = res["events"]
            H.first_problem(_events_problem(f"on {n} ranks, rank {r}, ParallelMLP {ph} (B*T*C = {numel})",
                                            ev.get(f"mlp {ph}", []), [("all_reduce", numel)])
                            for ph in ("forward", "backward"))
            if res["flops"] is None:
                raise AssertionError(f"on {n} ranks, rank {r}: ParallelMLP did not get as far as "
                                     f"its backward: {res['problem']}")
            for what, ok, share in zip(("forward", "backward"), res["carried"],
                                       ("output from its slice of the hidden layer", "input gradient")):
                assert ok, (f"on {n} ranks, rank {r}, ParallelMLP {what}: " + _NOT_CARRIED.format(
                    "the result was", f"partial {share}"))
            fwd, bwd, full_fwd, full_bwd = res["flops"]
            for what, got, full in (("forward", fwd, full_fwd), ("backward", bwd, full_bwd)):
                assert got * n == full, (
                    f"on {n} ranks, rank {r}, ParallelMLP {what}: {got} matrix-multiply FLOPs, "
                    f"the full MLP's {what} takes {full}: each rank should do 1/{n} of it, "
                    "its own slice's products only")


@check("10", points=2, name="find the bug: sequence_parallel_mlp's gradients, one all-gather and one reduce-scatter each way")
def _sp_grad(impl):
    numel = B * T * C
    want = [("all_gather", numel), ("reduce_scatter", numel)]
    for n, per_rank in _part(impl, "sp_grad"):
        H.first_problem(f"on {n} ranks: {res['problem']}" if res["problem"] else None for res in per_rank)
        for r, res in enumerate(per_rank):
            for phase in ("sp forward", "sp backward"):
                got = res["events"].get(phase, [])
                H.first_problem([_events_problem(f"on {n} ranks, rank {r}, sequence_parallel_mlp {phase}",
                                                 sorted(got), sorted(want))])


@check("10", points=2, name="find the bug: sequence_parallel_mlp's dropout: each rank its own mask, the default stream in step")
def _sp_dropout(impl):
    for n, per_rank in _part(impl, "sp_dropout"):
        H.first_problem(f"on {n} ranks: {res['problem']}" if res["problem"] else None for res in per_rank)
        masks = [res["masks"] for res in per_rank]
        assert not all(all(m) for ms in masks for m in ms[:2]), (
            f"on {n} ranks: with p={P_DROP} nothing was dropped: dropout must act when p > 0")
        assert any(masks[r][0] != masks[0][0] for r in range(1, n)), (
            f"on {n} ranks: every rank drew the same dropout mask for its positions. The ranks "
            "hold different positions of the sequence, so the mask repeats with period T/t "
            "along it: not a dropout of the whole. Each rank needs random numbers of its own here")
        streams = [res["stream"] for res in per_rank]
        assert all(s == streams[0] for s in streams), (
            f"on {n} ranks: after the call the default random stream differs from rank to rank "
            f"(torch.rand(4) gave {streams[0]} on rank 0, "
            f"{next(s for s in streams if s != streams[0])} on another). Dropout on replicated "
            "activations elsewhere draws from it and needs the same mask on every rank: leave "
            "it in step (the same on every rank after the call)")
        for r, ms in enumerate(masks):
            assert ms[1] != ms[0], (
                f"on {n} ranks, rank {r}: two calls in a row drew the same dropout mask: the "
                "numbers must move on from call to call, as the default stream does")
            assert ms[2] == ms[0], (
                f"on {n} ranks, rank {r}: run again from the same state of the default stream, "
                "the call drew another mask: activation recomputation replays a forward from "
                "that state and needs the same mask; derive this rank's numbers from it")


HINTS = {
    "_fg": [
        "Both are torch.autograd.Function subclasses with static forward(ctx, x, group) and "
        "backward(ctx, grad) (which returns one gradient per input of forward: None for group). "
        "Chapter 10's f/g section says why f sums backward and g sums forward.",
        "f forward returns x; its backward all-reduces the incoming gradient over ctx.group. "
        "g forward all-reduces over group; its backward returns the gradient as it came. Who "
        "else might hold the tensor you reduce?",
        "dist.all_reduce works in place: reduce a clone, both in g's forward (x is the caller's) "
        "and in f's backward (autograd may hand the same gradient tensor to another branch).",
    ],
    "_column": [
        "Rank r of t holds rows r*out/t to (r+1)*out/t of full.weight (and of full.bias): "
        "nn.Parameter of a clone of that slice. dist.get_rank(group) and "
        "dist.get_world_size(group) say r and t in the group.",
        "Forward: F.linear of the input with this rank's weight and bias. The input is whole on "
        "every rank and every rank's slice uses it: which of your two functions does it pass "
        "through first?",
    ],
    "_row": [
        "Rank r holds columns r*in/t to (r+1)*in/t of full.weight, and the whole bias.",
        "Forward: this rank's input block times its columns is a partial sum of every output; "
        "the partial sums meet in one of your two functions; then the bias.",
        "Added before the sum, a bias that every rank holds would be counted t times: add it "
        "after the reduction, once.",
    ],
    "_mlp": [
        "Your two layers from (b) are the building blocks, named as the full MLP's: which one "
        "is made from full.c_fc, which from full.c_proj?",
        "Between them goes the full MLP's GELU (approximate='tanh'), on this rank's hidden "
        "units only. Why does it need no communication, and what would go wrong with a "
        "function that mixed hidden units (a softmax over them)?",
    ],
    "_communication": [
        "Count what your MLP sends: f's backward and g's forward each one all-reduce of "
        "(B, T, C). Anything else (an all-gather of the hidden, a second all-reduce, a "
        "broadcast of the weights) is extra, and so is computing the full layer on every rank.",
        "The collectives must run on the group passed in: dist.all_reduce(t, group=group). "
        "Each rank multiplies only its own slice: no full weight kept, no full output made.",
    ],
    "_sp_grad": [
        "Run it on 2 ranks with p=0 and compare x.grad to one process's: by what factor is it off?",
        "Every rank used every position of the gathered input, so the gradient of each "
        "position is a sum over ranks, but a reduce-scatter already sums as it scatters. How "
        "many times is the gradient summed in _GatherPositions.backward?",
    ],
    "_sp_dropout": [
        "Print the dropout mask on two ranks after seeding both alike: what do you see, and "
        "why is that wrong for positions that differ from rank to rank?",
        "Each rank needs numbers of its own inside the sequence-parallel region, yet the "
        "default stream must come out the same on every rank, advance from call to call, and "
        "replay from the same state. torch.random.fork_rng() restores the stream on exit; what "
        "could you seed inside it from, so that all three hold?",
    ],
}
