"""Graded checks of exercise 02 (exercises/02_collectives.py), registered with exercises.grade.

The functions under test run where they must: in 2 and 3 processes of
minidist.run.pool.shared_pool (launch's processes, kept for the next grading), with a gloo
process group. The oracle is torch.distributed's own
all_reduce and all_gather on the same data; only the grader calls them.

Every message is recorded below torch.distributed's Python (exercises/_traffic.py), with
its peer, its bytes and a copy of what it carried: the ring's direction (RULES.on_traffic)
is judged in every part as each message is posted, the bytes per destination are read off
the recording, and each part checks that every chunk a rank ends with arrived in a message
from its left neighbour (the grader gathers the senders' copies), so that data moved any
other way does not count even where no hook can see it.

Starting processes is the slow part (seconds per launch on a small CPU), so one launch
per world size runs every sub-check of every check (a "part" per exercised function),
and the checks read the results from a cache. Parts that fail at 2 ranks are not run
again at 3 and 4: the check fails at the first world size that goes wrong anyway.

A part that hangs (a ring that deadlocks) or crashes leaves messages in flight that could
corrupt whatever runs after it, so that launch stops there and a fresh one runs the
parts after it. A watchdog stops a rank whose part runs longer than TIMEOUT_S, so a hang
costs seconds, not the grader.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import threading
from collections import Counter

import torch
import torch.distributed as dist

from exercises import _harness as H
from exercises import _rules, _traffic
from exercises._harness import per_world_size
from exercises.grade import check
from minidist import comm
from minidist.launch import LaunchError
from minidist.run.pool import shared_pool

WORLD_SIZES = (2, 3)  # 3 is the smallest ring where the direction matters
# A part still running after TIMEOUT_S hangs (a deadlock, an endless loop): the rank is
# stopped. Tests lower it. Process groups get the longer LAUNCH_TIMEOUT_S, as starting
# 4 processes on a busy machine can take a while.
TIMEOUT_S = 20.0
LAUNCH_TIMEOUT_S = 120.0
_HUNG = 124  # the exit code of a rank the watchdog stopped (as timeout(1) uses)


# --------------------------------------------------------------------- reference adapters

def reference_ring_reduce_scatter(chunks: list[torch.Tensor]) -> None:
    """minidist's ring reduce-scatter with the exercise's signature (minidist's takes a
    name for its byte counters and error messages as well)."""
    comm._ring_reduce_scatter(chunks, "ring_reduce_scatter")


def reference_ring_all_gather(chunks: list[torch.Tensor]) -> None:
    """minidist's ring all-gather with the exercise's signature."""
    comm._ring_all_gather(chunks, "ring_all_gather")


# --------------------------------------------------------------------- data and oracle

# Unit roundoff: the largest relative error of one rounding to the dtype.
_UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def _data(rank: int, shape, dtype, case: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + 104729 * case + 1)
    return torch.randn(shape, generator=g).to(dtype)


def _oracle_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over ranks of x, sum over ranks of |x|), by torch's all_reduce in float64: the
    sum is as good as exact, and the second sets the scale of the rounding errors."""
    exact = x.to(torch.float64, copy=True)
    scale = x.to(torch.float64, copy=True).abs()
    with _rules.exempt():  # the grader's oracle, not the learner's code
        dist.all_reduce(exact)
        dist.all_reduce(scale)
    return exact, scale


def _sum_problem(got: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor, n: int,
                 where: str) -> str | None:
    """None when `got` is the sum within tolerance, else what is wrong.

    Tolerance: a sum of N terms rounded to the dtype after each of its N-1 additions (the
    ring does that at each hop) and once more at the end is off by at most N roundings,
    each at most u * sum|x| (u: the unit roundoff, 2^-24 for float32, 2^-8 for bfloat16),
    whatever the order of the additions. We allow twice that: 2 * N * u * sum|x|. A
    missing or doubled contribution is off by a whole |x_i|, far outside it.
    """
    allowed = 2 * n * _UNIT_ROUNDOFF[got.dtype] * scale
    bad = ~((got.double() - exact).abs() <= allowed)  # written so that NaN counts as bad
    if not bad.any():
        return None
    i = int(bad.reshape(-1).nonzero()[0])
    return (f"{where}: element {i} is {got.reshape(-1)[i].item():.6g}, the sum over ranks is "
            f"{exact.reshape(-1)[i].item():.6g} ({int(bad.sum())} of {bad.numel()} elements "
            f"are off by more than 2*N*u*sum|x|)")


def _chunk_sizes(n: int) -> list[list[int]]:
    """Chunk sizes to test with: torch.tensor_split's nearly equal chunks of 1 element
    (more ranks than elements: empty chunks), 7 and 4099 (neither divisible by 2, 3 or 4),
    and chunks of very different sizes."""
    cases = [[len(c) for c in torch.arange(size).tensor_split(n)] for size in (1, 7, 4099)]
    cases.append([3 + 5 * (n - i) for i in range(n)])
    return cases


# --------------------------------------------------------------------- what the messages carried

def _received() -> list[torch.Tensor]:
    """What this rank's left neighbour sent it in the learner's call just made (the
    sender's copies, taken as it sent them), read off every rank's recording. Clears the
    recording for the next call. (The exchange is the grader's, exempt.)"""
    t = _traffic.current()
    mine = [(e.peer, e.data[0] if e.data else None) for e in t.events if e.kind == "send"]
    t.events.clear()
    everyone = [None] * dist.get_world_size()
    with _rules.exempt():
        dist.all_gather_object(everyone, mine)
    r = dist.get_rank()
    return [data for sender in everyone for peer, data in sender if peer == r and data is not None]


def _not_carried(where: str, got: torch.Tensor, own: torch.Tensor | None, came: list) -> str | None:
    """None when `got` arrived in one of the messages `came` (bit for bit), or, when `own`
    is given, is own plus one of them; else what is wrong. Data that reached the rank
    some other way than the recorded messages shows here."""
    if got.numel() == 0:
        return None
    for m in came:
        if m.numel() != got.numel():
            continue
        m = m.reshape(got.shape).to(got.dtype)
        if torch.equal(got, m):
            return None
        if own is not None and (torch.equal(got, own + m) or
                                torch.equal(got, (own.float() + m.float()).to(got.dtype))):
            return None
    what = "equals no message" if own is None else "is neither a message nor its own chunk plus one"
    return (f"{where} holds {got.numel()} values that no message from the left neighbour brought: "
            f"it {what} of the {len(came)} this rank received. In a ring every chunk a rank "
            "ends with arrives from its left neighbour (the one it finishes, its own plus the "
            "partial sum that arrives); data that reached it another way does not count")


# --------------------------------------------------------------------- the parts, run on every rank

def _reduce_scatter_part(fns: dict, r: int, n: int) -> list[str]:
    problems = []
    for case, sizes in enumerate(_chunk_sizes(n)):
        chunks = [_data(r, (s,), torch.float32, 100 * case + i) for i, s in enumerate(sizes)]
        exact, scale = _oracle_sum(torch.cat(chunks))  # the whole sum; we check our slice
        lo = sum(sizes[:r])
        exact, scale = exact[lo:lo + sizes[r]], scale[lo:lo + sizes[r]]
        before = list(chunks)  # the tensors themselves: the result must land in them
        own = chunks[r].clone()
        fns["ring_reduce_scatter"](chunks)
        came = _received()
        where = f"{n} ranks, chunk sizes {sizes}: rank {r}'s chunks[{r}]"
        if chunks[r] is not before[r]:
            problems.append(f"{where} was replaced by another tensor; update it in place "
                            "(add_, copy_), as all_reduce needs the sum inside its own views")
        elif (p := _sum_problem(before[r], exact, scale, n, where)) is not None:
            problems.append(p)
        elif n > 1 and (p := _not_carried(where, before[r], own, came)) is not None:
            problems.append(p)
    return problems


def _all_gather_part(fns: dict, r: int, n: int) -> list[str]:
    problems = []
    for case, sizes in enumerate(_chunk_sizes(n)):
        mine = _data(r, (sizes[r],), torch.float32, 100 * case + r)
        # what everyone should end with: rank i's own chunk i, gathered by torch (padded,
        # as torch's all_gather wants one size from everyone)
        width = max(max(sizes), 1)
        padded = torch.zeros(width)
        padded[:sizes[r]] = mine
        gathered = [torch.empty(width) for _ in range(n)]
        with _rules.exempt():
            dist.all_gather(gathered, padded)
        want = [g[:s] for g, s in zip(gathered, sizes)]
        # the chunks this rank does not own start as NaN, so a chunk never written shows
        chunks = [mine.clone() if i == r else torch.full((s,), float("nan"))
                  for i, s in enumerate(sizes)]
        before = list(chunks)
        fns["ring_all_gather"](chunks)
        came = _received()
        for i, (got, w) in enumerate(zip(before, want)):
            if torch.equal(got, w) and i != r:
                p = _not_carried(f"{n} ranks, chunk sizes {sizes}: rank {r}'s chunks[{i}]", got, None, came)
                if p is not None:
                    problems.append(p)
                    break
            if not torch.equal(got, w):
                j = int((got != w).nonzero()[0])  # NaN != anything: found too
                what = ("was never written (still NaN)" if got.isnan().all() else
                        f"element {j} is {got[j].item():.6g}, rank {i}'s is {w[j].item():.6g}")
                problems.append(f"{n} ranks, chunk sizes {sizes}: rank {r}'s chunks[{i}] {what}"
                                + ("; it must be received into the tensor in the list, in place"
                                   if chunks[i] is not got else ""))
                break
    return problems


def _chunks_not_carried(where: str, t: torch.Tensor, own: torch.Tensor, came: list, n: int) -> str | None:
    """Every chunk of the all-reduced `t` arrived in a message (or is own plus one)."""
    for i, (got, mine) in enumerate(zip(t.reshape(-1).tensor_split(n), own.reshape(-1).tensor_split(n))):
        if (p := _not_carried(f"{where}: chunk {i} of the result", got, mine, came)) is not None:
            return p
    return None


# float32 from 1 element (fewer than ranks) to a prime number of them, a 2-D tensor, and
# bfloat16, where every hop of the ring rounds.
_ALL_REDUCE_CASES = [(torch.float32, (1,)), (torch.float32, (7,)), (torch.float32, (1000,)),
                     (torch.float32, (4099,)), (torch.float32, (33, 31)),
                     (torch.bfloat16, (1,)), (torch.bfloat16, (7,)), (torch.bfloat16, (1000,)),
                     (torch.bfloat16, (4099,))]


def _all_reduce_part(fns: dict, r: int, n: int) -> dict[str, list[str]]:
    problems = {"float32": [], "bfloat16": []}
    for case, (dtype, shape) in enumerate(_ALL_REDUCE_CASES):
        t = _data(r, shape, dtype, 1000 + case)
        exact, scale = _oracle_sum(t)
        own = t.clone()
        out = fns["all_reduce"](t)
        came = _received()
        name = str(dtype).removeprefix("torch.")
        where = f"all_reduce of a {name} tensor of shape {tuple(shape)} on {n} ranks, rank {r}"
        p = _sum_problem(t, exact, scale, n, where)
        if (p is not None and isinstance(out, torch.Tensor) and out is not t
                and out.shape == t.shape and out.dtype == t.dtype
                and _sum_problem(out, exact, scale, n, where) is None):
            p = f"{where}: returned the sum in a new tensor; it belongs in `tensor` itself"
        if p is None and n > 1:
            p = _chunks_not_carried(where, t, own, came, n)
        if p is not None:
            problems[name].append(p)
    return problems


# The exercise's rules, watched in every part while the learner's code runs (see
# exercises/_rules.py): only send and recv may move data.
# minidist's modules for this exercise's idea: the learner's file may not name them
# (exercises/_filecheck.py reads it before anything runs)
IDEA_MODULES = ("minidist.comm",)
_RING_RULE = ("in every part of exercise 02 a rank sends only to its right neighbour, (r+1) % N, "
              "and receives only from its left neighbour, (r-1) % N: the ring of chapter 02")


def _ring_neighbours(e, r: int, n: int):
    """Exercise 02's rule on every message, judged as it is posted (exercises/_traffic.py)."""
    if e.kind == "send" and e.peer != (r + 1) % n:
        return f"a send from rank {r} to rank {e.peer}", _RING_RULE
    if e.kind == "recv" and e.peer is None:
        return f"a receive on rank {r} from any source", _RING_RULE
    if e.kind == "recv" and e.peer != (r - 1) % n:
        return f"a receive on rank {r} from rank {e.peer}", _RING_RULE
    return None


RULES = _rules.Rules(
    allowed=("send", "recv", "recv_anysource"),
    collective_rule="only dist.isend/irecv/send/recv may move data in exercise 02 (build the "
                    "ring from point-to-point messages)",
    on_traffic=_ring_neighbours)


# One size every world size divides (each rank then sends exactly 2(N-1)/N * S) and one
# none does (chunks differ by one element, so ranks send slightly different amounts).
_RING_SIZES = (1200, 4099)


def _ring_part(fns: dict, r: int, n: int) -> dict:
    """The bytes each rank sends, per destination (every send recorded below torch's
    Python, exercises/_traffic.py), in a run whose sum is checked as well."""
    runs = []
    for case, size in enumerate(_RING_SIZES):
        t = _data(r, (size,), torch.float32, 2000 + case)
        exact, scale = _oracle_sum(t)
        own = t.clone()
        _traffic.current().events.clear()
        fns["all_reduce"](t)
        sent = Counter()
        for e in _traffic.current().events:
            if e.kind == "send":
                sent[e.peer] += e.sent
        where = f"all_reduce of {size} float32 on {n} ranks, rank {r} (the run whose bytes are counted)"
        came = _received()
        carried = _chunks_not_carried(where, t, own, came, n) if n > 1 else None
        problem = _sum_problem(t, exact, scale, n, where) or carried
        chunk_bytes = [len(c) * t.element_size() for c in t.tensor_split(n)]
        runs.append({"size": size, "bytes": t.numel() * t.element_size(), "chunk_bytes": chunk_bytes,
                     "sent": dict(sent), "problem": problem, "carried": carried})
    return {"runs": runs}


_PARTS = {"reduce_scatter": _reduce_scatter_part, "all_gather": _all_gather_part,
          "all_reduce": _all_reduce_part, "ring": _ring_part}


class _PartFailed(RuntimeError):
    """Raised on a rank whose part could not finish; its message is already explained."""


def _explain(e: BaseException, timeout_s: float) -> str:
    """What went wrong in a rank (or, for a launch that failed, in the parent), with
    the likely cause of the failures that say little by themselves."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, _PartFailed):
        return str(e)
    # launch reports a rank that died without a word by its exit code
    who = re.search(r"rank \d+ of \d+", text) if isinstance(e, LaunchError) else None
    who = who.group(0) if who else "a rank"
    hung = isinstance(e, LaunchError) and f"code {_HUNG}" in text
    if hung or "timed out" in text.lower() or isinstance(e, TimeoutError):
        what = (f"{who} was still running after {timeout_s:.0f}s and was stopped" if hung
                else f"a wait ran out ({text})")
        return (f"timed out: {what}. Most likely the ring deadlocked: a blocking send waits "
                "for its receiver, so post dist.irecv and dist.isend before waiting on "
                "either, and match every send with a receive on the other rank (or a loop "
                "never ends)")
    if isinstance(e, LaunchError) and "code -6" in text:  # SIGABRT
        return (f"{who} was aborted: most likely gloo stopped it because a message arrived "
                "whose size differs from the receive buffer's (the rank's output above says "
                "so), that is, a send met the wrong receive. Check the neighbours and the "
                "chunk index of each step")
    return text


def _run_part(part: str, fns: dict, r: int, n: int, timeout_s: float) -> tuple[str, object]:
    """("ok", results) | ("notimpl", hint) | ("rule", what was used) | ("error", why), on
    this rank. The rules are watched for the whole part: a collective scores it 0."""
    # A hang ends this rank: no exception can reach a thread blocked inside gloo, and
    # gloo's own timeout is the process group's, kept long for slow start-ups. launch
    # sees the rank die, stops the others, and the parent reads the exit code.
    def stop():
        os.write(2, f"[rank {r} of {n}] {part}: still running after {timeout_s:.0f}s, "
                    "stopped by the grader\n".encode())
        os._exit(_HUNG)

    watchdog = threading.Timer(timeout_s, stop)
    watchdog.daemon = True
    watchdog.start()
    w = None
    try:
        with _rules.watching(RULES) as w, _traffic.recording(w, RULES):
            try:
                outcome = "ok", _PARTS[part](fns, r, n)
            except NotImplementedError as e:
                outcome = "notimpl", str(e)
        return ("rule", w.broken[0]) if w.broken else outcome
    except Exception as e:
        if w is not None and w.broken:
            return "rule", w.broken[0]
        return "error", _explain(e, timeout_s)
    finally:
        watchdog.cancel()


def _worker(fns: dict, parts: list[str], timeout_s: float, progress: str) -> dict:
    """Run `parts` in order on this rank; return {part: [outcome of each rank]}.

    After each part rank 0 also writes what is done so far to the file `progress`: when
    a part hangs or a rank dies, launch raises and returns nothing, and the parent learns
    from the file which parts finished and which one did not.
    """
    r, n = dist.get_rank(), dist.get_world_size()
    done = {}
    for part in parts:
        outcome = _run_part(part, fns, r, n, timeout_s)
        if outcome[0] == "error":
            # stop this launch: messages left in flight could corrupt the next part
            raise _PartFailed(outcome[1])
        # every rank learns every rank's outcome, and none goes on to the next part
        # before all have finished this one
        gathered = [None] * n
        dist.all_gather_object(gathered, outcome)
        done[part] = gathered
        if r == 0:
            with open(progress + ".tmp", "wb") as f:
                pickle.dump(done, f)
            os.replace(progress + ".tmp", progress)
    return done


# --------------------------------------------------------------------- running, cached

_CACHE: dict = {}


def _results(impl) -> dict:
    """{(part, world size): ("ok", [per-rank results]) | ("notimpl", hint) | ("error", why)}.

    Computed once per implementation: the key holds the functions themselves, so the
    stubs, the reference and a test's mistakes never share results (and, held here, no
    function is freed and its id reused by another).
    """
    fns = {"ring_reduce_scatter": impl.ring_reduce_scatter,
           "ring_all_gather": impl.ring_all_gather, "all_reduce": impl.all_reduce}
    key = (*fns.values(), WORLD_SIZES, TIMEOUT_S)  # tests change the last two
    if _CACHE.get("key") != key:
        _CACHE.clear()
        _CACHE.update(key=key, results=_run_all(fns))
    return _CACHE["results"]


def _run_all(fns: dict) -> dict:
    results, failed = {}, set()
    with tempfile.TemporaryDirectory(prefix="minidist-grade-02-") as tmp:
        for n in WORLD_SIZES:
            todo = [p for p in _PARTS if p not in failed]
            while todo:
                progress = os.path.join(tmp, f"{n}-{len(todo)}.pkl")  # one file per launch
                try:
                    # the functions travel to the ranks as arguments: cloudpickle sends
                    # module-level functions by name (exercises is a package), lambdas by value
                    done, why = shared_pool(n).run(_worker, fns, todo, TIMEOUT_S, progress,
                                                   timeout_s=LAUNCH_TIMEOUT_S)[0], None
                except Exception as e:
                    done, why = _load(progress), _explain(e, TIMEOUT_S)
                for part, outcomes in done.items():
                    results[part, n] = _summary(outcomes, n)
                    if results[part, n][0] != "ok":
                        failed.add(part)
                todo = todo[len(done):]
                if why is None:
                    continue
                # todo[0] was running when the launch failed: it fails, the rest go on
                stopped = {todo[0]: why}
                if todo[0] == "all_reduce" and "ring" in todo:  # it runs all_reduce again
                    stopped["ring"] = f"all_reduce did not finish in the correctness run: {why}"
                for part, msg in stopped.items():
                    results[part, n] = ("error", msg)
                    failed.add(part)
                todo = [p for p in todo if p not in stopped]
    return results


def _load(progress: str) -> dict:
    try:
        with open(progress, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:  # no part finished
        return {}


def _summary(outcomes: list, n: int) -> tuple[str, object]:
    for r, (kind, payload) in enumerate(outcomes):
        if kind != "ok":
            return kind, f"[rank {r} of {n}] {payload}" if kind != "notimpl" else payload
    return "ok", [payload for _, payload in outcomes]


def _per_world_size(impl, part: str):
    """Yield (n, per-rank results) for n = 2, 3, 4 (see _harness.per_world_size)."""
    return per_world_size(_results(impl), part, WORLD_SIZES)


def _first(problem_lists) -> None:
    for problems in problem_lists:
        if problems:
            raise AssertionError(problems[0])


# --------------------------------------------------------------------- the checks

@check("02", points=2,
       name="ring_reduce_scatter: rank r gets chunk r summed (2-4 ranks, uneven chunks)")
def _reduce_scatter(impl):
    for _, per_rank in _per_world_size(impl, "reduce_scatter"):
        _first(per_rank)


@check("02", points=2,
       name="ring_all_gather: every rank gets every chunk (2-4 ranks, uneven chunks)")
def _all_gather(impl):
    for _, per_rank in _per_world_size(impl, "all_gather"):
        _first(per_rank)


@check("02", points=2, name="all_reduce float32 == torch's (1, 7, 1000, 4099 elements; 2-D)")
def _all_reduce_fp32(impl):
    for _, per_rank in _per_world_size(impl, "all_reduce"):
        _first(p["float32"] for p in per_rank)


@check("02", points=1, name="all_reduce bfloat16 == torch's, within 2N roundings")
def _all_reduce_bf16(impl):
    for _, per_rank in _per_world_size(impl, "all_reduce"):
        _first(p["bfloat16"] for p in per_rank)


@check("02", points=1, name="all_reduce moves data with isend/irecv/send/recv only")
def _point_to_point_only(impl):
    # every part runs under RULES, and the recorder (exercises/_traffic.py) notes any other
    # way of moving data it sees; this is the all_reduce the bytes are counted of, whose
    # result must have arrived in the recorded messages
    for _, per_rank in _per_world_size(impl, "ring"):
        H.first_problem(run["carried"] for res in per_rank for run in res["runs"])


@check("02", points=2, name="all_reduce is a ring: 2(N-1)/N*S bytes per rank, all to rank r+1")
def _ring_bytes(impl):
    for n, per_rank in _per_world_size(impl, "ring"):
        for case in range(len(_RING_SIZES)):
            runs = [res["runs"][case] for res in per_rank]
            H.first_problem(run["problem"] for run in runs)  # the run that counts sums as well
            S, chunks = runs[0]["bytes"], runs[0]["chunk_bytes"]
            what = f"all_reduce of {runs[0]['size']} float32 ({S} bytes) on {n} ranks"
            for r, run in enumerate(runs):
                right = (r + 1) % n
                elsewhere = {dst: b for dst, b in run["sent"].items() if dst != right and b}
                assert not elsewhere, (
                    f"{what}: rank {r} sent {elsewhere} (bytes by destination rank); in a "
                    f"ring it sends only to its right neighbour, rank {right}")
                # Reduce-scatter sends every chunk but the one the rank finishes with,
                # all-gather every chunk but the one it receives last: 2S less two chunks.
                got = run["sent"].get(right, 0)
                lo, hi = 2 * (S - max(chunks)), 2 * (S - min(chunks))
                assert lo <= got <= hi, (
                    f"{what}: rank {r} sent {got} bytes; a ring sends 2(N-1)/N * S = "
                    f"{2 * (n - 1) * S / n:.0f}" + (f" (between {lo} and {hi} with chunks of "
                                                     f"{min(chunks)} and {max(chunks)} bytes)"
                                                     if lo != hi else ""))
            # every chunk travels N-1 hops in each half, whoever sends it
            total = sum(run["sent"].get((r + 1) % n, 0) for r, run in enumerate(runs))
            assert total == 2 * (n - 1) * S, (
                f"{what}: the ranks sent {total} bytes together; a ring sends 2(N-1) * S = "
                f"{2 * (n - 1) * S}")


# Tiered hints, shown one at a time by `python -m exercises.grade 02 --hint`: first the
# idea, then the index arithmetic, then the detail that trips most people.
HINTS = {
    "_reduce_scatter": [
        "N-1 steps. At each step every rank sends one chunk to rank (r+1) % N and receives "
        "one chunk from rank (r-1) % N into a scratch tensor (torch.empty_like), then adds "
        "the scratch into its own copy of that chunk. A partial sum picks up one rank's "
        "contribution per hop.",
        "Choose the chunk index of each step from r and the step number k so that the last "
        "chunk rank r adds into is chunks[r]. Work it out for N=3 on paper: which chunk must "
        "rank r send at the first step so that, travelling right and picking up one "
        "contribution per hop, chunk r ends its trip at rank r?",
        "Post both halves of a step before waiting on either (dist.irecv and dist.isend "
        "return works to wait on). If every rank calls a blocking dist.send first, every rank "
        "waits for a receive nobody has posted (chapter 02, section 2). Add into the chunk "
        "in place: chunks[r] must stay the same tensor.",
    ],
    "_all_gather": [
        "N-1 steps again, copying, not adding: at each step send to the right the chunk "
        "you completed most recently (your own, chunks[r], at the first step) and receive "
        "the next one from the left.",
        "What a rank sends at a step is what it received at the step before (its own "
        "chunk, complete since the reduce-scatter, at the first). Receive straight into the "
        "list's tensor for that chunk: no scratch tensor, nothing to add.",
    ],
    "_all_reduce_fp32": [
        "tensor.view(-1) and the pieces torch.tensor_split cuts from it are views that share "
        "tensor's memory: whatever your two ring functions write into them lands in tensor "
        "itself. Run ring_reduce_scatter then ring_all_gather on the same list of views.",
        "With one rank there is nothing to do; with more ranks than elements some chunks are "
        "empty, and sending an empty tensor is fine as long as both sides do it. Return "
        "`tensor`, not a new one.",
    ],
    "_all_reduce_bf16": [
        "bfloat16 rounds at every hop; that is allowed (2N roundings). Send the native "
        "dtype: converting to float32 for the wire doubles the bytes.",
    ],
    "_point_to_point_only": [
        "The message names the collective your code called. The exercise is to build the "
        "sum from dist.isend/irecv (or send/recv) only: no dist.all_reduce per chunk, no "
        "dist.broadcast or all_gather for the second half.",
    ],
    "_ring_bytes": [
        "A ring sends only to the right neighbour, (r + 1) % N. A ring that sends left is "
        "also a ring, but not the one asked for: the direction matters in chapter 03, where "
        "buckets are paired by order.",
        "Each half sends N-1 chunks per rank: reduce-scatter every chunk but the one the "
        "rank finishes with, all-gather every chunk but the one it receives last. Sending "
        "the whole tensor, or a chunk twice, shows up as too many bytes.",
    ],
}
