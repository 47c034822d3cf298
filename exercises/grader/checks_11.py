"""Graded checks of exercise 11 (exercises/11_pipeline.py). A tiny GPT (minidist.model's, head untied so that
each stage's gradients compare alone) cut into p stages, one per rank of the shared pool; the learner's schedule
runs on every stage at each m, on a group whose timeout is the deadlock watchdog. Oracles: one process running
the whole model on the whole batch (its gradients, the gradient at each cut); 1F1B's order, by definition."""

import copy
import datetime
import functools
import itertools
import os
import sys
import sysconfig
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn

import minidist.pipeline.schedules as _pp
from exercises.grader import Cache, Rules, check, close, differ, first_problem, per_world_size, run_all
from exercises.grader.rules import RuleBroken, current
from minidist.model import GPT, GPTConfig

WORLD_SIZES, TIMEOUT_S = (2, 3), 60.0  # pipeline stages p, one per rank; the limit of one part
CASE_TIMEOUT_S = 5.0  # the pipe's group timeout: a wait this long for a message is a deadlock
CFG = GPTConfig(block_size=8, vocab_size=64, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
MB, T, SEED = 2, 8, 1234  # micro-batch size, sequence length
SHAPE = (MB, T, CFG.n_embd)
RTOL, ATOL = 1e-4, 1e-6   # fp32: one batch or m micro-batches differ only in the order of sums
# the micro-batch counts run at p stages, longest steady state first
grid = lambda p: sorted({1, p - 1, p, 2 * p + 1} - {0}, reverse=True)  # noqa: E731


# --------------------------------------------------------------------- the rules
_NO_TORCH_PP = "torch's pipelining is this exercise's answer: write the schedule yourself"
_BLOCKING = "every message is one blocking dist.send or dist.recv, in an order that cannot deadlock"
RULES = Rules(
    frozenset({"send", "recv"}), "messages only, dist.send and dist.recv: no collective, not even a barrier",
    {**{f"torch.distributed.pipelining{k}": _NO_TORCH_PP for k in (
        ":pipeline", ":PipelineStage", ":ScheduleGPipe", ":Schedule1F1B", ".schedules:_PipelineSchedule")},
     **{f"minidist.pipeline.schedules:{k}": "minidist.pipeline is this exercise's answer"
        for k in ("one_f_one_b", "gpipe", "exchange", "pipeline_step")}})
# dist.send and dist.recv are isend/irecv and a wait, inside torch: the rule refuses those only where the code
# under test calls them itself (minidist's answer, the reference, posts batches; RULES keeps the learner from
# it). The wrappers also record each message. They are in place only while a schedule runs (the core, seeing
# this file's frame, records none).
_REAL = lambda path: os.path.realpath(path) + os.sep  # noqa: E731
_TORCH, _STDLIB = _REAL(os.path.dirname(torch.__file__)), _REAL(sysconfig.get_paths()["stdlib"])
_NOT_JUDGED = (_REAL(os.path.dirname(__file__)), _REAL(os.path.dirname(_pp.__file__)))
_MESSAGES: list = []
_where = lambda f: f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno}" if f else "?"  # noqa: E731


def _frames(f, wrapper):  # (the first caller that is no wrapper, the first outside torch and the stdlib)
    inside = lambda f, *more: f is not None and (  # noqa: E731
        f.f_code is wrapper or os.path.realpath(f.f_code.co_filename).startswith(more))
    while inside(f):
        f = f.f_back
    caller = f
    while inside(f, _TORCH, _STDLIB):
        f = f.f_back
    return caller, f


def _refusing(name: str, orig):
    def call(*a, **k):
        caller, f = _frames(sys._getframe(1), call.__code__)  # every wrapper's code is call's
        if name != "batch_isend_irecv":  # torch's send, recv and batches pass the group's rank,
            peer = k.get("group_dst", k.get("group_src"))  # the stage's (the pipe is the world)
            _MESSAGES.append(("send" if name == "isend" else "recv", peer, _where(f)))
        path = os.path.realpath(f.f_code.co_filename) if f else _TORCH
        if not os.path.realpath(caller.f_code.co_filename).startswith(_TORCH) and \
                not path.startswith(_NOT_JUDGED):  # called by the code under test, not torch's send
            current().note(f"dist.{name} was called", _where(f), _BLOCKING)
            raise RuleBroken(current().broken[-1])  # noted for the part's score, raised to stop it
        return orig(*a, **k)
    return functools.update_wrapper(call, orig)


@contextmanager
def _rules_in_force():
    with ExitStack() as stack:
        for name in ("isend", "irecv", "batch_isend_irecv"):  # torch's own globals, names imported
            new = _refusing(name, orig := getattr(dist.distributed_c10d, name))
            for mod in list(sys.modules.values()):
                held = getattr(mod, "__dict__", {}).get(name)
                if held is orig or getattr(held, "__wrapped__", None) is orig:  # (or the core's wrapper)
                    stack.enter_context(mock.patch.object(mod, name, new))
        yield


# --------------------------------------------------------------------- reference adapters
class _Talking:
    """This exercise's run, driven the way minidist.pipeline's schedules drive theirs."""
    def __init__(self, run):
        self.run, self.s = run, SimpleNamespace(stage=run.stage, stages=run.stages)
        self.x, self.out, self.g_out, self.g_in = {}, {}, {}, {}

    def talk(self, send_act=None, recv_act=None, send_grad=None, recv_grad=None) -> None:
        r = self.run
        sends = [(box.pop(i), peer) for i, box, peer in (
            (send_act, self.out, r.next), (send_grad, self.g_in, r.prev)) if None not in (i, peer)]
        recvs = [(box.setdefault(i, torch.empty(r.shape)), peer) for i, box, peer in (
            (recv_act, self.x, r.prev), (recv_grad, self.g_out, r.next)) if None not in (i, peer)]
        _pp.exchange(r.group, sends, recvs)

    def forward(self, i: int) -> None:
        self.out[i] = self.run.forward(i, self.x.pop(i, None))

    def backward(self, j: int) -> None:
        self.g_in[j] = self.run.backward(j, self.g_out.pop(j, None))


def reference_one_f_one_b(run, m: int) -> None:  # minidist.pipeline's 1F1B on this exercise's run
    _pp.one_f_one_b(_Talking(run), m)


def reference_draft_gpipe(run, m: int) -> None:  # minidist.pipeline's GPipe on this exercise's run
    _pp.gpipe(_Talking(run), m)


# --------------------------------------------------------------------- the model and the oracle
@functools.lru_cache(maxsize=1)
def _gpt() -> GPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        gpt = GPT(CFG)
    gpt.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())  # untied
    return gpt


_layers = lambda p, s: _pp.split_layers(CFG.n_layer, p)[s]  # noqa: E731 - stage s's blocks, extras first


def _owned(p: int, s: int) -> tuple:  # what stage s's parameters' names begin with
    return ((("wte.", "wpe.") if s == 0 else ()) + tuple(f"blocks.{i}." for i in _layers(p, s))
            + (("ln_f.", "lm_head.") if s == p - 1 else ()))


def _stage_forward(model: GPT, p: int, s: int, x, y, keep=None):
    """Stage s of p: the embeddings on the first, its blocks, the final norm and head on the
    last (which returns the summed loss); `keep` gets each block's output, its grad kept."""
    x = model.embed(x) if s == 0 else x
    for i in _layers(p, s):
        x = model.blocks[i](x)
        if keep is not None:
            x.retain_grad()
            keep[i] = x
    return model.head(x, y, reduction="sum")[1] if s == p - 1 else x


def _micro_batches(m: int) -> torch.Tensor:  # (m, 2, MB, T): micro-batch i's tokens, targets
    return torch.randint(0, CFG.vocab_size, (m, 2, MB, T), generator=torch.Generator().manual_seed(SEED + m))


@functools.lru_cache(maxsize=8)  # one process, whole model, whole batch: its gradients, and each block output's
def _oracle(m: int):
    whole, keep = copy.deepcopy(_gpt()), {}
    x, y = _micro_batches(m).transpose(0, 1).reshape(2, m * MB, T)
    (_stage_forward(whole, 1, 0, x, y, keep) / (m * MB * T)).backward()
    return {n: q.grad for n, q in whole.named_parameters()}, {k: v.grad.split(MB) for k, v in keep.items()}


# ------------------------------------------------------------- the run handed to the schedule
class _Run:
    """One stage's state for one run of the schedule (see exercises/11_pipeline.py)."""
    def __init__(self, s: int, p: int, m: int, group):
        self.stage, self.stages, self.group, self.shape = s, p, group, SHAPE
        self.prev, self.next = (s - 1 if s > 0 else None), (s + 1 if s < p - 1 else None)
        self.model, self.m, self.mbs = copy.deepcopy(_gpt()), m, _micro_batches(m)
        self.order, self.held, self.grads = [], {}, {}

    def _check(self, i, t, what: str, end: bool) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.m:
            raise RuntimeError(f"{what} on stage {self.stage}: micro-batches are 0 to {self.m - 1}")
        if (t is not None) if end else (not isinstance(t, torch.Tensor) or tuple(t.shape) != SHAPE):
            raise RuntimeError(f"{what} on stage {self.stage}: want " + (
                "None (an end of the pipe)" if end else f"a tensor of run.shape {SHAPE}"))
        return i

    def forward(self, i, x=None):
        i = self._check(i, x, f"forward({i!r}, x)", self.prev is None)
        if ("F", i) in self.order:
            raise RuntimeError(f"forward({i}) on stage {self.stage} ran twice")
        leaf = None if x is None else x.detach().requires_grad_()  # the buffer itself, as received
        x, y = self.mbs[i] if leaf is None else (leaf, self.mbs[i][1])
        out = _stage_forward(self.model, self.stages, self.stage, x, y)
        self.held[i] = (leaf, out / (self.m * MB * T) if self.next is None else out)
        self.order.append(("F", i))
        return None if self.next is None else out.detach()

    def backward(self, i, grad=None):
        i = self._check(i, grad, f"backward({i!r}, grad)", self.next is None)
        if i not in self.held:
            why = "ran twice" if ("B", i) in self.order else f"before forward({i})"
            raise RuntimeError(f"backward({i}) on stage {self.stage} {why}")
        leaf, out = self.held.pop(i)
        torch.autograd.backward(out, grad)
        self.order.append(("B", i))
        if leaf is not None:
            self.grads[i] = leaf.grad.clone()
            return leaf.grad

    def differences(self) -> dict:
        """What differs from the oracle: parameters, and micro-batches whose input gradient does."""
        want, grads = _oracle(self.m)
        owned = _owned(self.stages, self.stage)
        mine = {n: q.grad for n, q in self.model.named_parameters() if n.startswith(owned)}
        params = [n for n, g in mine.items() if g is None or not close(g, want[n], RTOL, ATOL)]
        detail = differ(params[0], mine[params[0]], want[params[0]], "the oracle's", RTOL, ATOL) if params else ""
        above = _layers(self.stages, self.stage)[0] - 1  # the block whose output is its input
        return {"params": params, "of": len(mine), "detail": detail,
                "grads": [i for i, g in self.grads.items() if not close(g, grads[above][i], RTOL, ATOL)]}


# --------------------------------------------------------------------- the part, on every rank
_KEPT: list = []  # a group that timed out still holds posted messages: never freed mid-flight
_CACHE = Cache()  # the results of both parts, per implementation


def _sweep(fns, s: int, p: int, name: str, case_timeout_s: float) -> list:
    """Run fns[name] on stage s of p at every m of grid(p), until a run does not finish."""
    group = dist.new_group(list(range(p)), timeout=datetime.timedelta(seconds=case_timeout_s))
    schedule, cases, stop = fns[name], [], None
    for m in grid(p):
        run, seen, case = _Run(s, p, m, group), len(_MESSAGES), {"m": m, "status": "ok", "why": ""}
        try:
            with _rules_in_force():
                schedule(run, m)
            if run.held:
                case.update(status="error", why=f"stage {s} returned before backward({min(run.held)})")
        except (NotImplementedError, RuleBroken) as e:  # raised once every stage has stopped
            stop, case["status"] = e, "stop"
        except Exception as e:  # noqa: BLE001 - the schedule's failure, reported
            text, sent = f"{type(e).__name__}: {e}", _MESSAGES[seen:]
            if "timed out" in text.lower() or "connection closed" in text.lower():
                kind, peer, where = sent[-1] if sent else ("message", "?", "?")
                done = " ".join(f"{k}{i}" for k, i in run.order) or "nothing"
                to = "to" if kind == "send" else "from"
                case.update(status="hung", why=f"stage {s} waited in a {kind} {to} stage {peer} ({where}), "
                                               f"having run {done}")
            else:
                case.update(status="error", why=f"stage {s}: {text}")
        case["order"] = run.order
        if case["status"] == "ok":
            case.update(run.differences())
        cases.append(case)
        dist.all_reduce(worst := torch.tensor([int(case["status"] != "ok")]), op=dist.ReduceOp.MAX)
        if worst.item():  # what is left posted could corrupt the next run
            _KEPT.append(group)
            break
    if stop is not None:
        raise stop
    return cases


def _runs(impl, part: str):
    """Yield (p, m, [each stage's case]) for the runs of `part` that every stage made."""
    fns = {"one_f_one_b": impl.one_f_one_b, "draft_gpipe": impl.draft_gpipe}
    parts = {part: functools.partial(_sweep, name=name, case_timeout_s=CASE_TIMEOUT_S)
             for part, name in (("schedule", "one_f_one_b"), ("draft", "draft_gpipe"))}
    results = _CACHE.get((*fns.values(), CASE_TIMEOUT_S),  # tests shorten the watchdog
                         lambda: run_all(parts, fns, WORLD_SIZES, TIMEOUT_S))
    for p, per_rank in per_world_size(results, part, WORLD_SIZES):
        for k in range(min(len(cases) for cases in per_rank)):
            yield p, per_rank[0][k]["m"], [cases[k] for cases in per_rank]


def _stuck(p: int, m: int, stages: list, label: str) -> str | None:
    bad = [c for c in stages if c["status"] in ("hung", "error")]
    hung = any(c["status"] == "hung" for c in bad)
    how = f"deadlocked (a wait over {CASE_TIMEOUT_S:.0f}s)" if hung else "failed"
    return f"{label}: at p={p}, m={m} it {how}: " + "; ".join(c["why"] for c in bad) if bad else None


def _finished_runs(impl, part: str, label: str):
    """The runs that finished; one with m >= p (run first) that did not fails the check:
    without a steady state there is nothing to judge. The deadlock check has the rest."""
    for p, m, stages in _runs(impl, part):
        if not (why := _stuck(p, m, stages, label)):
            yield p, m, stages
        elif m >= p:
            raise AssertionError(why)


def _gradients(impl, part: str, label: str) -> None:
    right, wrong = {p: [] for p in WORLD_SIZES}, []
    for p, m, stages in _finished_runs(impl, part, label):
        bad = [s for s, c in enumerate(stages) if c["params"] or c["grads"]]
        (wrong.append((p, m, stages, bad)) if bad else right[p].append(m))
    if not wrong:
        return
    p, m, stages, bad = min(wrong, key=lambda w: w[:2])  # the smallest run that is wrong
    c, ms = stages[bad[-1]], lambda xs: ", ".join(map(str, sorted(xs)))  # noqa: E731
    said = [f"the gradients of {ms(c['params'])} differ ({c['detail']}); its other "
            f"{c['of'] - len(c['params'])} are right" if c["params"] else "its parameters are right"]
    said += [f"the input gradients its backward returned for micro-batch(es) {ms(c['grads'])} "
             f"(of 0 to {m - 1}) differ"] if c["grads"] else []
    raise AssertionError(
        f"{label}: at p={p}, m={m}, stage(s) {ms(bad)} (of 0 to {p - 1}) differ from one process "
        f"running the whole batch. On stage {bad[-1]}, " + "; ".join(said) + f". At p={p}: right "
        f"for m = {ms(right[p]) or 'none'}, wrong for m = {ms(w[1] for w in wrong if w[0] == p)}")


def _1f1b_order(p: int, s: int, m: int) -> list:
    w = min(p - s - 1, m)
    steady = [x for j in range(m - w) for x in (("F", w + j), ("B", j))]
    return [("F", i) for i in range(w)] + steady + [("B", j) for j in range(m - w, m)]


# --------------------------------------------------------------------- the checks
@check("11", 3, name="1F1B: every stage's gradients equal one process's on the whole batch", hints=[
    "On stage s, what must have arrived before run.forward(i, x), and before run.backward(i, grad)? What does "
    "each end of the pipe receive and send?",
    "A message carries no label: a receive gets whatever its neighbour sent next. Do both ends agree on each "
    "message's micro-batch, and does each go forward and back once?",
    "Chapter 11, section 2: a warm-up of min(p - s - 1, m) forwards, a steady state of one forward and one "
    "backward (the oldest in flight), a cool-down of the backwards left."])
def _schedule_grads(impl):
    _gradients(impl, "schedule", "one_f_one_b")


@check("11", 2, name="1F1B: each stage runs 1F1B's order, min(p - stage, m) in flight", hints=[
    "How many forwards must stage s run before micro-batch 0's gradient can come back from the last stage? "
    "GPipe runs all m of them first; 1F1B as few as it can.",
    "Then one forward and one backward of the oldest micro-batch in flight, then the backwards left "
    "(chapter 11, section 2)."])
def _schedule_order(impl):
    show = lambda o: " ".join(f"{k}{i}" for k, i in o[:14]) + " ..." * (len(o) > 14)  # noqa: E731
    peak = lambda o: max(itertools.accumulate(1 - 2 * (k == "B") for k, _ in o), default=0)  # noqa: E731
    for p, m, stages in _finished_runs(impl, "schedule", "one_f_one_b"):
        for s, c in enumerate(stages):
            got, want = c["order"], _1f1b_order(p, s, m)
            assert got == want, (f"one_f_one_b: at p={p}, m={m}, stage {s} ran {show(got)} ({peak(got)} in "
                                 f"flight at most); 1F1B runs {show(want)} ({peak(want)} at most)")


@check("11", 3, name="1F1B: no deadlock: every run finishes (m = 1, p - 1, p, 2p + 1)", hints=[
    "A blocking send returns only once its receiver has posted the matching receive. On one link, write down "
    "in order the messages each end posts: when can the first one finish?",
    "In the steady state stage s sends an activation down, then wants a gradient from below; the stage below "
    "sends that gradient up, then wants the activation. Both send first: both wait forever (chapter 11, "
    "section 1, \"Why nothing deadlocks\").",
    "On each link one end receives first where the other sends first, the same for every pair on it, and no "
    "two links may wait on each other: decide by the stage (its index's parity) or by the message (which kind "
    "goes first), and follow p = 3 by hand."])
def _schedule_finishes(impl):
    first_problem(_stuck(p, m, stages, "one_f_one_b") for p, m, stages in _runs(impl, "schedule"))


@check("11", 2, name="find the bug: draft_gpipe's gradients equal one process's at every m", hints=[
    "Which runs are right and which wrong? Compare m = 1 with m = 2; at the highest stage that differs, which "
    "parameters, and which micro-batches' gradients?",
    "The last micro-batch comes out right, the earlier ones do not: what do the micro-batches of one stage "
    "share, and which parameter would notice it first?",
    "Backward of micro-batch i reads what its forward saved, its input included (chapter 11, section 1, the "
    "receive buffers): is that input still micro-batch i's by then?"])
def _draft(impl):
    _gradients(impl, "draft", "draft_gpipe")
    first_problem(_stuck(p, m, stages, "draft_gpipe") for p, m, stages in _runs(impl, "draft"))
