"""Graded checks of exercise 11 (exercises/11_pipeline.py), registered with exercises.grade.

Every schedule runs where it must: in 2 and 4 processes of minidist.run.pool's shared pools
(exercises/_harness.py), one pipeline stage per rank, on a process group the grader makes
for the pipe. The grader builds the stages itself: a tiny GPT (minidist.model's blocks,
four of them) cut into p stages of contiguous blocks, the embeddings on the first, the
final norm and the head on the last. The head holds its own copy of the embedding matrix
(untied), so that every stage's gradient can be compared alone. The oracle is one
process's gradient accumulation over the same micro-batches, computed on every rank from
the same seed (the whole model: it is tiny), never numbers copied from a run.

The learner's schedule is handed a `run` (see exercises/11_pipeline.py): forward(i),
backward(i) and the tensors the messages carry. The run counts what really happened: the
order of forwards and backwards (the micro-batches in flight are counted from it), and
refuses what cannot be (a forward before its input arrived, a backward before its
gradient did, a micro-batch done twice). Its state lives in closures, out of reach of
learner code (the file check refuses __closure__).

While a schedule runs, the grader records every point-to-point call and every collective,
below torch.distributed's Python where every road to gloo meets (exercises/_traffic.py, as
exercise 10 does), with its peer, its size and what it carried; a group's backend object
called directly, a group of the learner's own or the store scores the part 0. A message to a stage other than a neighbour, or on a
process group other than the pipe's, trips the rule there and then; the collectives trip
exercises/_rules.py's watch. A part that trips a rule scores 0, naming it.

Deadlocks. gloo's send waits until the receiver has posted its receive, so a schedule whose
neighbours both send first hangs for real. Each run has a watchdog: the pipe's process
group times out after CASE_TIMEOUT_S, the waiting rank raises, and the grader reports the
case (p, m) and the last messages each stage had posted. A case that hangs or fails ends
the sweep of its part (what was in flight could corrupt the next one); the sweep runs the
large micro-batch counts first, where the steady state is longest.

The rules are enforced twice (see LEARNER_RULES):
- before anything runs, the learner's file is read (exercises/_filecheck.py): naming
  minidist.pipeline, minidist.pipeline.measure or minidist.compose.pipeline_sync, torch's
  torch.distributed.pipelining, a collective, the grader, or reaching modules by name at
  run time fails every check, naming the line;
- while it runs: importing or calling torch.distributed.pipelining, calling any function
  or class of minidist's pipeline modules (lifted only for the reference adapters below,
  recognised by identity), and every collective.
"""

from __future__ import annotations

import copy
import datetime
import functools
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import minidist.pipeline.schedules as _pp
import minidist.compose.pipeline_sync as _pp_compose
import minidist.pipeline.measure as _pp_measure
from exercises import _harness as H
from exercises import _rules
from exercises.grade import check
from minidist.model import GPT, GPTConfig

WORLD_SIZES = (2, 4)        # pipeline stages p: one per rank
M_GRID = (8, 5, 4, 3, 2, 1)  # micro-batch counts, run in this order (see the docstring)
TIMEOUT_S = 40.0             # the harness's limit for one part; tests lower it
CASE_TIMEOUT_S = 5.0         # one schedule run's watchdog: a wait this long is a deadlock
CFG = GPTConfig(block_size=8, vocab_size=64, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
MB, T = 2, 8                 # micro-batch size and sequence length
SEED = 1234
RTOL, ATOL = 1e-5, 1e-7      # fp32; the order of the accumulation may differ
HANG_HINT = ("On every link both stages must post the same messages in the same order; a "
             "send waits for its receive.")

# --------------------------------------------------------------------- the rules

_NO_TORCH_PP = ("exercise 11 writes the pipeline schedule itself: torch.distributed.pipelining "
                "(its stages and schedules, under any name) is not yours to use")
_NO_MINIDIST = ("exercise 11 is yours to write: minidist.pipeline, minidist.pipeline.measure "
                "and minidist.compose.pipeline_sync are its answer, not building blocks")
_P2P_RULE = ("exercise 11 moves activations and gradients only by point-to-point messages "
             "between neighbouring stages, on the pipe's group run.group (the helpers' "
             "dist.batch_isend_irecv, or dist.isend/irecv/send/recv): no collectives")
_PIPELINING = "torch.distributed.pipelining"


class _IfImported(dict):
    """Rules.apis with all of torch.distributed.pipelining that is loaded added: every
    function and class its modules define, public or private, and every method those
    classes define (an object made without its constructor still trips when used).
    Importing it costs seconds per process, so it is not imported only to be watched:
    while it is not loaded, _ForbiddenImports trips on importing it."""

    def items(self):
        found = list(super().items())
        for name, mod in list(sys.modules.items()):
            if mod is not None and (name == _PIPELINING or name.startswith(_PIPELINING + ".")):
                found += [(api, _NO_TORCH_PP) for api in _rules.defined_in(mod)]
        return found


class _ForbiddenImports:
    """A meta-path finder, first in line during a part: importing torch's pipelining trips
    the rule (recorded on the part's watch, as a tripwire would)."""

    def find_spec(self, name, path=None, target=None):
        w, _ = _rules.current()
        if w is not None and (name == _PIPELINING or name.startswith(_PIPELINING + ".")):
            w.trip(f"import {name}", _NO_TORCH_PP)
        return None


def _module_apis(mod, rule: str) -> dict:
    """Every function and class a module defines, as _rules.Rules.apis entries."""
    return {f"{mod.__name__}.{name}": rule for name, obj in vars(mod).items()
            if callable(obj) and getattr(obj, "__module__", None) == mod.__name__}


_ALLOWED = ("send", "recv")
LEARNER_RULES = _rules.Rules(allowed=_ALLOWED, collective_rule=_P2P_RULE, apis=_IfImported({
    **_module_apis(_pp, _NO_MINIDIST), **_module_apis(_pp_measure, _NO_MINIDIST),
    **_module_apis(_pp_compose, _NO_MINIDIST)}))
# minidist's own schedule, graded through the adapters below, is watched for these
REFERENCE_RULES = _rules.Rules(allowed=_ALLOWED, collective_rule=_P2P_RULE, apis=_IfImported())
# What grade.py watches in this process, where no learner code runs (see exercises/checks_10.py)
RULES = REFERENCE_RULES
# minidist's modules for this exercise's idea, and torch's: the learner's file may not
# name them (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.pipeline", "minidist.pipeline.measure", "minidist.compose.pipeline_sync")
FILE_RULES = {_PIPELINING: _NO_TORCH_PP}


def file_problems(source: str, filename: str = "exercises/11_pipeline.py") -> list[str]:
    """What in a learner's file breaks a rule, each with its line: read, never run."""
    from exercises import _filecheck
    table = _filecheck.forbidden_names(LEARNER_RULES, IDEA_MODULES, (), FILE_RULES)
    return _filecheck.problems(source, filename, table)


# --------------------------------------------------------------------- reference adapters
# minidist's schedule with this exercise's interface: minidist.pipeline's schedules talk
# through a _Run's talk(); this one posts the same batches through the grader's run.

class _Talking:
    def __init__(self, run):
        self.run, self.forward, self.backward = run, run.forward, run.backward
        self.s = SimpleNamespace(stage=run.stage, stages=run.stages)

    def talk(self, send_act=None, recv_act=None, send_grad=None, recv_grad=None) -> None:
        r, sends, recvs = self.run, [], []
        if send_act is not None and r.next is not None:
            sends.append((r.output(send_act), r.next))
        if send_grad is not None and r.prev is not None:
            sends.append((r.input_grad(send_grad), r.prev))
        if recv_act is not None and r.prev is not None:
            recvs.append((r.new_input(recv_act), r.prev))
        if recv_grad is not None and r.next is not None:
            recvs.append((r.new_output_grad(recv_grad), r.next))
        _pp.exchange(r.group, sends, recvs)


def reference_one_f_one_b(run, m: int) -> None:
    _pp.one_f_one_b(_Talking(run), m)


def reference_draft_one_f_one_b(run, m: int) -> None:
    """The bug fixed: the send and the receive that cross on one link go as one batch
    (minidist.pipeline's 1F1B does exactly that)."""
    _pp.one_f_one_b(_Talking(run), m)


NAMES = ("one_f_one_b", "draft_one_f_one_b")
_REFERENCES = (reference_one_f_one_b, reference_draft_one_f_one_b)


def _trusted(impl) -> bool:
    return all(getattr(impl, n) is f for n, f in zip(NAMES, _REFERENCES))


# --------------------------------------------------------------------- the model and the oracle

class _StageModel(nn.Module):
    """Blocks `layers` of the tiny GPT, with the embeddings when `first` and the final norm
    and the (untied) head when `last`; parameters named as in the whole model. Forward:
    tokens in on the first stage, the previous stage's activation elsewhere; out, the
    activation, or on the last stage the loss summed over the targets."""

    def __init__(self, gpt: GPT, head: nn.Linear, layers, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = copy.deepcopy(gpt.wte), copy.deepcopy(gpt.wpe)
        self.blocks = nn.ModuleDict({str(i): copy.deepcopy(gpt.blocks[i]) for i in layers})
        if last:
            self.ln_f, self.head = copy.deepcopy(gpt.ln_f), copy.deepcopy(head)

    def forward(self, x, y=None):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1)))
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), reduction="sum")


@functools.lru_cache(maxsize=1)
def _model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        gpt = GPT(CFG)
    head = nn.Linear(CFG.n_embd, CFG.vocab_size, bias=False)
    head.weight = nn.Parameter(gpt.wte.weight.detach().clone())  # untied: see the docstring
    return gpt, head


def _layers(p: int, s: int) -> range:
    per = CFG.n_layer // p  # 4 blocks over 2 or 4 stages
    return range(s * per, (s + 1) * per)


def _micro_batches(m: int):
    g = torch.Generator().manual_seed(SEED + m)
    return [(torch.randint(0, CFG.vocab_size, (MB, T), generator=g),
             torch.randint(0, CFG.vocab_size, (MB, T), generator=g)) for _ in range(m)]


def _oracle(m: int) -> dict:
    """One process's gradient accumulation over the m micro-batches: {name: gradient}."""
    gpt, head = _model()
    whole = _StageModel(gpt, head, range(CFG.n_layer), True, True)
    scale = 1.0 / (m * MB * T)
    for x, y in _micro_batches(m):
        (whole(x, y) * scale).backward()
    return {n: p.grad for n, p in whole.named_parameters()}


# --------------------------------------------------------------------- the run handed to the schedule

class _Refused(RuntimeError):
    """What the run refuses (a forward before its input, a micro-batch done twice)."""


def _make_run(model: _StageModel, s: int, p: int, m: int, group, labels: dict):
    """The run a schedule drives on stage s (see exercises/11_pipeline.py), and its
    record: {"order": [("F", i), ("B", j), ...]}. Its state lives in these closures."""
    mbs, scale = _micro_batches(m), 1.0 / (m * MB * T)
    first, last = s == 0, s == p - 1
    shape = (MB, T, CFG.n_embd)
    inputs, outputs, out_grads, done_b, order = {}, {}, {}, set(), []
    record = {"order": order}

    def _mb(i, what):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < m:
            raise _Refused(f"{what}({i!r}) on stage {s}: micro-batches are the ints 0 to {m - 1}")
        return i

    def forward(i):
        i = _mb(i, "forward")
        if i in outputs or i in done_b:
            raise _Refused(f"forward({i}) on stage {s} ran twice")
        if first:
            x = mbs[i][0]
        elif i not in inputs:
            raise _Refused(f"forward({i}) on stage {s} before micro-batch {i}'s activation "
                           f"was received from stage {s - 1}")
        else:
            x = inputs[i].requires_grad_()
        out = model(x, mbs[i][1] if last else None)
        outputs[i] = out * scale if last else out
        order.append(("F", i))

    def backward(j):
        j = _mb(j, "backward")
        if j not in outputs:
            raise _Refused(f"backward({j}) on stage {s} " + ("ran twice" if j in done_b else
                                                            f"before forward({j})"))
        if not last and j not in out_grads:
            raise _Refused(f"backward({j}) on stage {s} before the gradient of its output was "
                           f"received from stage {s + 1}")
        out = outputs.pop(j)
        if last:
            out.backward()
        else:
            torch.autograd.backward(out, out_grads.pop(j))
        done_b.add(j)
        order.append(("B", j))

    def output(i):
        i = _mb(i, "output")
        if last:
            raise _Refused(f"output({i}): the last stage sends no activation (it makes the loss)")
        if i not in outputs:
            raise _Refused(f"output({i}) on stage {s} before forward({i}) (or after backward({i}))")
        t = outputs[i].detach()
        labels[t.data_ptr()] = f"activation {i}"
        return t

    def input_grad(j):
        j = _mb(j, "input_grad")
        if first:
            raise _Refused(f"input_grad({j}): the first stage's input is tokens: no gradient to send")
        if j not in done_b or inputs[j].grad is None:
            raise _Refused(f"input_grad({j}) on stage {s} before backward({j})")
        labels[inputs[j].grad.data_ptr()] = f"gradient {j}"
        return inputs[j].grad

    def new_input(i):
        i = _mb(i, "new_input")
        if first:
            raise _Refused(f"new_input({i}): the first stage receives no activation (it reads tokens)")
        if i in inputs:
            raise _Refused(f"new_input({i}) on stage {s}: micro-batch {i}'s activation was received twice")
        inputs[i] = torch.empty(shape)
        labels[inputs[i].data_ptr()] = f"activation {i}"
        return inputs[i]

    def new_output_grad(j):
        j = _mb(j, "new_output_grad")
        if last:
            raise _Refused(f"new_output_grad({j}): the last stage's output is the loss: no "
                           "gradient comes to it")
        if j in out_grads or j in done_b:
            raise _Refused(f"new_output_grad({j}) on stage {s}: its gradient was received twice")
        out_grads[j] = torch.empty(shape)
        labels[out_grads[j].data_ptr()] = f"gradient {j}"
        return out_grads[j]

    def unfinished():
        never = [i for i in range(m) if i not in done_b]
        return never

    ranks = dist.get_process_group_ranks(group)
    run = SimpleNamespace(stage=s, stages=p, group=group,
                          prev=None if first else ranks[s - 1], next=None if last else ranks[s + 1],
                          forward=forward, backward=backward, output=output, input_grad=input_grad,
                          new_input=new_input, new_output_grad=new_output_grad)
    return run, record, unfinished


# --------------------------------------------------------------------- recording

_KIND = {"send": "send", "recv": "recv", "recv_anysource": "recv"}


class _Recorder:
    """Every message and collective that reaches a process group from Python while a
    schedule runs: (kind, peer stage, elements, what it carried). A message to a stage
    other than a neighbour, or on another group than the pipe's, trips the rule."""

    def __init__(self, group, s: int, p: int, labels: dict):
        self.events, self.labels, self.s = [], labels, s
        self.mine = {id(group), id(group._get_backend(torch.device("cpu")))}
        self.neighbours = {s - 1, s + 1} & set(range(p))

    def _seen(self, pg, name, args):
        tensors = args[0] if args and isinstance(args[0], (list, tuple)) else []
        t = tensors[0] if tensors and isinstance(tensors[0], torch.Tensor) else None
        peer = args[1] if name in ("send", "recv") and len(args) > 1 else None
        carried = self.labels.get(t.data_ptr(), "a tensor of yours") if t is not None else "?"
        self.events.append((_KIND.get(name, name), peer, 0 if t is None else t.numel(), carried))
        w = _rules.current()[0]
        if name not in _KIND:
            return  # a collective: exercises/_rules.py's watch trips on it
        if id(pg) not in self.mine:
            w.trip(f"a {_KIND[name]} on another process group than run.group", _P2P_RULE)
        if name == "recv_anysource" or peer not in self.neighbours:
            who = "any stage" if name == "recv_anysource" else f"stage {peer}"
            w.trip(f"a {_KIND[name]} between stage {self.s} and {who} (not a neighbour)", _P2P_RULE)

    def recording(self):
        return H.watching_process_groups(self._seen, (*_rules.COLLECTIVES, "send", "recv", "recv_anysource"))


# --------------------------------------------------------------------- the part, run on every rank

_HUNG_GROUPS: list = []  # a hung pipe's group still holds posted messages: never freed mid-flight


def _group(n: int, timeout_s: float):
    with _rules.exempt():  # the grader's group: the recorder hands it out to the learner's code
        return dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=timeout_s))


def _grad_problem(model: _StageModel, want: dict, s: int) -> str | None:
    for name, prm in model.named_parameters():
        g, w = prm.grad, want[name]
        if g is None:
            return f"stage {s}: {name} has no gradient"
        if not bool(((g - w).abs() <= ATOL + RTOL * w.abs()).all()):
            k = int((g - w).abs().argmax())
            return (f"stage {s}: the gradient of {name} differs from one process's accumulation: "
                    f"element {k} is {g.reshape(-1)[k].item():.6g}, want {w.reshape(-1)[k].item():.6g}")
    return None


def _agree(code: int) -> int:
    """The worst outcome code of any rank (the grader's own collective, exempt)."""
    t = torch.tensor([code])
    with _rules.exempt():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def _sweep(schedule, r: int, n: int, grid, case_timeout_s: float) -> list:
    """Run `schedule` on stage r of n at each m of `grid`, until one fails. Per case:
    {"m", "status" ("ok" | "hung" | "error" | "wrong"), "why", "order", "events"}."""
    p, s = n, r
    group = _group(n, case_timeout_s)
    gpt, head = _model()
    cases, stop_with = [], None
    for m in grid:
        want = _oracle(m)
        model = _StageModel(gpt, head, _layers(p, s), s == 0, s == p - 1)
        labels: dict = {}
        run, record, unfinished = _make_run(model, s, p, m, group, labels)
        rec = _Recorder(group, s, p, labels)
        case = {"m": m, "status": "ok", "why": None, "order": record["order"], "events": rec.events}
        try:
            with rec.recording():
                schedule(run, m)
            if never := unfinished():
                case["status"], case["why"] = "error", (
                    f"stage {s}: the schedule returned before micro-batch(es) {never} had "
                    "their backward")
            elif problem := _grad_problem(model, want, s):
                case["status"], case["why"] = "wrong", problem
        except (KeyboardInterrupt, SystemExit):
            raise  # the harness's watchdog (an endless loop) or an exit: the part ends
        except (NotImplementedError, _rules.RuleBroken) as e:
            stop_with = e  # raised after every rank has stopped (below)
            case["status"], case["why"] = "stop", str(e)
        except Exception as e:  # noqa: BLE001 - the schedule's failure, reported
            text = f"{type(e).__name__}: {e}"
            timed_out, cut_off = "timed out" in text.lower(), "connection closed" in text.lower()
            if timed_out or cut_off:  # gloo's timeout, or a neighbour's that closed the link
                last = [ev for ev in rec.events if ev[0] in ("send", "recv")][-2:]
                posted = "; ".join(f"{k} {what} {'to' if k == 'send' else 'from'} stage {peer}"
                                   for k, peer, _, what in last) or "nothing"
                waited = (f"waited more than {case_timeout_s:.0f}s for a message" if timed_out else
                          "was still waiting when a neighbour gave up")
                case["status"], case["why"] = "hung", (
                    f"stage {s} {waited} (its last messages posted: {posted})")
            else:
                case["status"], case["why"] = "error", f"stage {s}: {text}"
        cases.append(case)
        worst = _agree({"ok": 0, "wrong": 1, "error": 2, "hung": 2, "stop": 3}[case["status"]])
        if worst >= 2:  # a failed run may leave messages posted: the sweep stops here
            if worst == 2 and case["status"] == "ok":
                case["status"] = "stopped"  # finished here, but another stage did not
            _HUNG_GROUPS.append(group)
            break
    if stop_with is not None:
        raise stop_with
    return cases


def _schedule_part(fns: dict, r: int, n: int, grid=M_GRID, case_timeout_s=CASE_TIMEOUT_S) -> list:
    return _sweep(fns["one_f_one_b"], r, n, grid, case_timeout_s)


def _draft_part(fns: dict, r: int, n: int, grid=M_GRID, case_timeout_s=CASE_TIMEOUT_S) -> list:
    return _sweep(fns["draft_one_f_one_b"], r, n, grid, case_timeout_s)


def _guarded(part):
    """The part with _ForbiddenImports in place."""
    @functools.wraps(part)
    def run(fns, r, n, **kw):
        finder = _ForbiddenImports()
        sys.meta_path.insert(0, finder)
        try:
            return part(fns, r, n, **kw)
        finally:
            sys.meta_path.remove(finder)
    return run


_PARTS = {"schedule": _guarded(_schedule_part), "draft": _guarded(_draft_part)}
_CACHE = H.Cache()


def _results(impl) -> dict:
    fns = {n: getattr(impl, n) for n in NAMES}
    rules = REFERENCE_RULES if _trusted(impl) else LEARNER_RULES
    key = (*fns.values(), WORLD_SIZES, M_GRID, TIMEOUT_S, CASE_TIMEOUT_S)  # tests change the last ones
    parts = {name: functools.partial(part, grid=M_GRID, case_timeout_s=CASE_TIMEOUT_S)
             for name, part in _PARTS.items()}
    return _CACHE.get(key, lambda: H.run_all(parts, fns, WORLD_SIZES, TIMEOUT_S, HANG_HINT, rules))


def _sweeps(impl, part: str):
    """Yield (p, [the cases of each stage]) per world size."""
    yield from H.per_world_size(_results(impl), part, WORLD_SIZES)


def _cases(per_rank: list):
    """[(m, [each stage's case])] for the m's every stage ran."""
    ms = [c["m"] for c in per_rank[0]]
    return [(m, [next(c for c in cases if c["m"] == m) for cases in per_rank]) for m in ms
            if all(any(c["m"] == m for c in cases) for cases in per_rank)]


def _failure(p: int, m: int, stages: list) -> str | None:
    """Why the run (p, m) did not finish, naming each stage that failed, or None."""
    bad = [c for c in stages if c["status"] in ("hung", "error", "stop")]
    if not bad:
        return None
    kind = "deadlocked" if any(c["status"] == "hung" for c in bad) else "failed"
    return f"at p={p}, m={m} the schedule {kind}: " + " | ".join(c["why"] for c in bad[:p])


def _messages_problem(p: int, m: int, s: int, events: list) -> str | None:
    """Each link carries m activations down and m gradients up, one message each."""
    act = MB * T * CFG.n_embd
    want = []
    if s > 0:
        want += [("recv", s - 1, act)] * m + [("send", s - 1, act)] * m
    if s < p - 1:
        want += [("send", s + 1, act)] * m + [("recv", s + 1, act)] * m
    got = [(k, peer, size) for k, peer, size, _ in events]
    if sorted(got, key=str) != sorted(want, key=str):
        return (f"at p={p}, m={m}, stage {s} posted {len(got)} messages "
                f"({', '.join(sorted({f'{k} of {size} elements with stage {peer}' for k, peer, size in got}))}), "
                f"want {len(want)}: on each link m activations of micro-batch x T x n_embd = {act} "
                "elements down and m gradients of that size up, one message each, nothing else")
    return None


def _in_flight(order: list) -> int:
    now = most = 0
    for kind, _ in order:
        now += 1 if kind == "F" else -1
        most = max(most, now)
    return most


def _inflight_problem(p: int, m: int, stages: list) -> str | None:
    for s, c in enumerate(stages):
        got, want = _in_flight(c["order"]), min(p - s, m)
        if got != want:
            shown = " ".join(f"{k}{i}" for k, i in c["order"][:16])
            more = " ..." if len(c["order"]) > 16 else ""
            return (f"at p={p}, m={m}, stage {s} held {got} micro-batches between their forward "
                    f"and their backward at once; 1F1B holds min(p - stage, m) = {want}. Its order "
                    f"was: {shown}{more}")
    return None


def _grads(impl, part: str, label: str) -> None:
    for p, per_rank in _sweeps(impl, part):
        for m, stages in _cases(per_rank):
            why = _failure(p, m, stages)
            if why:
                if m >= p:  # the steady state must run: nothing to compare without it
                    raise AssertionError(f"{label}: {why}")
                continue  # m < p: the deadlock check says so
            H.first_problem(f"{label}: at p={p}, m={m}, {c['why']}" if c["status"] == "wrong" else None
                            for c in stages)
            H.first_problem(_messages_problem(p, m, s, c["events"]) for s, c in enumerate(stages))


def _finishes(impl, part: str, label: str) -> None:
    for p, per_rank in _sweeps(impl, part):
        cases = _cases(per_rank)
        for m, stages in cases:
            if why := _failure(p, m, stages):
                raise AssertionError(f"{label}: {why}")
        ran = [m for m, _ in cases]
        if ran != list(M_GRID)[:len(ran)] or len(ran) < len(M_GRID):
            raise AssertionError(f"{label}: at p={p} only m = {ran} ran, want {list(M_GRID)}")


# --------------------------------------------------------------------- the checks

@check("11", points=3, name="1F1B: every stage's gradients equal one process's accumulation (p = 2, 4; m = 1 to 8)")
def _schedule_grads(impl):
    _grads(impl, "schedule", "one_f_one_b")


@check("11", points=2, name="1F1B: at most min(p - stage, m) micro-batches in flight on each stage")
def _schedule_in_flight(impl):
    for p, per_rank in _sweeps(impl, "schedule"):
        for m, stages in _cases(per_rank):
            if _failure(p, m, stages):
                if m >= p:
                    raise AssertionError(f"one_f_one_b: {_failure(p, m, stages)}")
                continue
            H.first_problem([_inflight_problem(p, m, stages)])


@check("11", points=2, name="1F1B: no deadlock: every run finishes under the watchdog, m = 1 to 8")
def _schedule_finishes(impl):
    _finishes(impl, "schedule", "one_f_one_b")


@check("11", points=3, name="find the bug: draft_one_f_one_b finishes at every m, with 1F1B's gradients and in-flight count")
def _draft(impl):
    _finishes(impl, "draft", "draft_one_f_one_b")
    _grads(impl, "draft", "draft_one_f_one_b")
    for p, per_rank in _sweeps(impl, "draft"):
        for m, stages in _cases(per_rank):
            H.first_problem([_inflight_problem(p, m, stages)])


HINTS = {
    "_schedule_grads": [
        "Every micro-batch must go forward through every stage and its gradient back through "
        "every stage, once: on stage s, forward(i) needs micro-batch i's activation received "
        "from stage s - 1 first (recv_forward), and backward(i) needs the gradient of its "
        "output received from stage s + 1 (recv_backward); after forward(i) its output goes "
        "down (send_forward), after backward(i) its input's gradient goes up (send_backward).",
        "Check your indices at the ends of the pipe: the first stage receives no activations "
        "and the last no gradients (the helpers skip those), and every micro-batch 0 to m - 1 "
        "needs exactly one forward and one backward on every stage.",
    ],
    "_schedule_in_flight": [
        "A micro-batch is in flight on a stage from its forward to its backward. GPipe runs "
        "all m forwards first, so it holds m. How early can stage s start its first "
        "backward? Count the forwards that must happen before micro-batch 0's gradient can "
        "come back from the last stage.",
        "Stage s runs a few forwards first (a warm-up: enough to fill the stages below it), "
        "then alternates one forward with one backward of the oldest micro-batch in flight, "
        "then finishes the backwards left. How long is the warm-up on stage s, and what if m "
        "is smaller than that?",
    ],
    "_schedule_finishes": [
        "Run your schedule with minidist.launch on 2 and 4 processes at m = 1, 2, 3: which m "
        "hangs? A gloo send waits until the neighbour has posted the matching receive. Write "
        "down, for one link, the order in which each side posts its messages.",
        "In the steady state stage s sends an activation down and next wants a gradient from "
        "below, while the stage below sends a gradient up and next wants an activation. Which "
        "helper posts a send and a receive together? And when m is smaller than the warm-up, "
        "is there a steady state at all on every stage?",
    ],
    "_draft": [
        "Run draft_one_f_one_b on 2 processes at m = 1 and m = 2. One finishes, one hangs: "
        "where is each stage waiting when it hangs?",
        "Both neighbours post a blocking send first and their receive second: each send waits "
        "for a receive that the other side posts only after its own send has finished. Post "
        "the two that cross on one link together, on both stages.",
    ],
}
