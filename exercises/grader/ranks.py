"""Run graded parts of an exercise on the ranks of minidist's shared process pools.

Starting processes is the slow part, so one call per world size runs every "part" (a
function `part(fns, rank, world_size) -> picklable result`) and the checks read the results
from a `Cache`, computed once per implementation. Each part runs under the exercise's rules
(rules.py; a part reads its collectives with `events()`). A part that hangs or crashes
may leave messages in flight, so its launch stops there: after a crash a fresh launch runs
the parts after it; after a hang they are not run and fail saying why. gloo's timeout ends
a wait on a message that never comes, a watchdog a rank stuck in Python. A part that fails
at one world size is not run at the next.
"""

import _thread
import os
import pickle
import tempfile
import threading

import torch
import torch.distributed as dist

from exercises.grader.rules import current, watch
from minidist.launch import LaunchError
from minidist.run.pool import shared_pool


class PartFailed(RuntimeError):
    """Raised on a rank whose part could not finish; its message is already explained."""


def explain(e: BaseException, timeout_s: float, hang_hint: str = "") -> str:
    """What went wrong in a rank (or, for a launch that failed, in the parent)."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, PartFailed):
        return str(e)
    if "timed out" in text.lower() or isinstance(e, TimeoutError):
        return (f"timed out: a rank waited more than {timeout_s:.0f}s for a collective that "
                f"the other ranks did not join (a hang). {hang_hint} ({text})")
    if isinstance(e, LaunchError) and "code -6" in text:  # SIGABRT
        return (f"{text}. Most likely gloo aborted it because the ranks' collectives did not "
                "match (different sizes or a different order on different ranks)")
    return text


def _hung(why: str) -> bool:
    # explain()'s words for a hang (a rank's message comes prefixed with "[rank r of n] ")
    return "timed out: a rank waited" in why or "was still busy after" in why


def _run_part(part, fns: dict, r: int, n: int, timeout_s: float, hang_hint: str,
              rules=None):
    """("ok", result) | ("notimpl", hint) | ("rule", what was used) | ("error", why), on
    this rank, under the exercise's rules."""
    # gloo's timeout ends a wait on a message; this, a loop polling work.is_completed()
    limit = timeout_s + 10
    watchdog = threading.Timer(limit, _thread.interrupt_main)
    watchdog.daemon = True
    watchdog.start()
    w = None
    try:
        with watch(rules) as w:
            try:
                outcome = "ok", part(fns, r, n)
            except NotImplementedError as e:
                outcome = "notimpl", str(e)
        return ("rule", w.broken[0]) if w.broken else outcome
    except KeyboardInterrupt:
        return "error", f"rank {r} was still busy after {limit:.0f}s (an endless loop?)"
    except SystemExit as e:  # the learner's exit ends the part, not the rank
        return "error", f"rank {r}: your code called sys.exit({e.code!r}) (exiting is not an answer)"
    except BaseException as e:  # noqa: BLE001 - reported as text: only the grader's types travel
        if w is not None and w.broken:  # the rule tripped, and the part failed of it
            return "rule", w.broken[0]
        return "error", explain(e, timeout_s, hang_hint)
    finally:
        watchdog.cancel()


def _worker(fns: dict, parts: list, timeout_s: float, hang_hint: str, progress: str,
            rules=None) -> dict:
    """Run `parts` [(name, function)] in order on this rank: {name: [each rank's outcome]}.
    Rank 0 appends each outcome to `progress`, where the parent finds what finished when a
    launch fails."""
    r, n = dist.get_rank(), dist.get_world_size()
    done = {}
    for name, part in parts:
        outcome = _run_part(part, fns, r, n, timeout_s, hang_hint, rules)
        if outcome[0] == "error":
            # said in a file before this rank leaves the group: a peer that then fails with
            # "connection closed" may be heard first, and the parent reads the cause here
            _write(f"{progress}.why{r}", outcome[1])
            raise PartFailed(outcome[1])  # stop: messages in flight could corrupt the next part
        # every rank learns every rank's outcome; none starts the next part before all
        # have finished this one
        gathered = [None] * n
        dist.all_gather_object(gathered, outcome)
        done[name] = gathered
        if r == 0:
            with open(progress, "ab") as f:
                pickle.dump((name, gathered), f)
    return done


def _write(path: str, obj) -> None:
    """Pickle `obj` to `path`, whole or not at all."""
    with open(path + ".tmp", "wb") as f:
        pickle.dump(obj, f)
    os.replace(path + ".tmp", path)


def _cause(progress: str, n: int, why: str) -> str:
    """Why the launch failed: a rank's own account of a hang (or of any failure, when a
    peer's closed connection was heard first), from the files ranks write before leaving."""
    told = {}
    for r in range(n):
        try:
            with open(f"{progress}.why{r}", "rb") as f:
                told[r] = pickle.load(f)
        except (OSError, pickle.PickleError, EOFError):
            continue
    hung = [r for r, msg in told.items() if _hung(msg)]
    if hung and not _hung(why):
        return f"[rank {hung[0]} of {n}] {told[hung[0]]}"
    if told and ("connection closed" in why.lower() or "connection reset" in why.lower()):
        r = min(told)
        return f"[rank {r} of {n}] {told[r]}"
    return why


def _summary(outcomes: list, n: int) -> tuple[str, object]:
    for r, (kind, payload) in enumerate(outcomes):
        if kind != "ok":
            return kind, f"[rank {r} of {n}] {payload}" if kind in ("error", "rule") else payload
    return "ok", [payload for _, payload in outcomes]


def run_all(parts: dict, fns: dict, world_sizes, timeout_s: float, hang_hint: str = "",
            rules=None) -> dict:
    """{(part name, world size): ("ok", [per-rank results]) | ("notimpl", hint) |
    ("error", why)} for the parts `parts` ({name: function}) at each world size:
    `world_sizes` lists them (every part at each), or maps each to the part names to run.
    `rules` (an exercises.grader.rules.Rules; by default those of the check that asks) is
    watched in every part."""
    if rules is None and current() is not None:  # the rules of the check asking
        rules = current().rules
    plan = world_sizes if isinstance(world_sizes, dict) else {n: list(parts) for n in world_sizes}
    results, failed = {}, {}  # failed: {part: (world size, its result there)}
    with tempfile.TemporaryDirectory(prefix="minidist-grade-") as tmp:
        for n, names in plan.items():
            for p in names:
                if p in failed:  # it would fail here too: say where it did
                    m, (kind, why) = failed[p]
                    results[p, n] = (kind, why if kind in ("notimpl", "rule") else
                                     f"not run, as it failed on {m} rank(s): {why}")
            todo = [p for p in names if p not in failed]
            while todo:
                progress = os.path.join(tmp, f"{n}-{len(todo)}.pkl")  # one file per launch
                try:
                    # the deadline stops a rank stuck where no watchdog runs yet (the
                    # learner's module loading on the rank, exercises/_learner.py)
                    done, why = shared_pool(n).run(_worker, fns, [(p, parts[p]) for p in todo],
                                                   timeout_s, hang_hint, progress, rules,
                                                   timeout_s=timeout_s,
                                                   deadline_s=(timeout_s + 15) * len(todo) + 30)[0], None
                except Exception as e:
                    done, why = _load(progress), _cause(progress, n, explain(e, timeout_s, hang_hint))
                for name, outcomes in done.items():
                    results[name, n] = _summary(outcomes, n)
                    if results[name, n][0] != "ok":
                        failed[name] = (n, results[name, n])
                todo = todo[len(done):]
                if why is None:
                    continue
                # todo[0] was running when the launch failed: it fails; after a hang the
                # rest fail too, unrun, after a crash a fresh launch runs them
                stopped = {todo[0]: why}
                if _hung(why):
                    stopped.update({p: f"not run: the part before it hung ({why})" for p in todo[1:]})
                for p, msg in stopped.items():
                    results[p, n] = ("error", msg)
                    failed[p] = (n, results[p, n])
                todo = [p for p in todo if p not in stopped]
    return results


def _load(progress: str) -> dict:
    """The parts `progress` records as finished (a record cut short by a kill is not one)."""
    done = {}
    try:
        with open(progress, "rb") as f:
            while True:
                name, gathered = pickle.load(f)
                done[name] = gathered
    except (FileNotFoundError, EOFError, pickle.UnpicklingError):  # none finished; the end; a record cut short
        pass
    return done


class Cache:
    """Results of `run_all`, once per implementation: the key holds the functions themselves
    (so no function is freed and its id reused) and whatever else changes the run."""

    def __init__(self):
        self.key, self.results = None, None

    def get(self, key, compute):
        if self.key != key:
            self.key, self.results = key, compute()
        return self.results


def per_world_size(results: dict, part: str, world_sizes):
    """Yield (n, per-rank results) for each world size; a part that did not run fails the
    check here: a stub's NotImplementedError with its hint, or why it did not finish."""
    for n in world_sizes:
        kind, payload = results.get((part, n), ("error", "not run"))
        if kind == "notimpl":
            raise NotImplementedError(payload)
        if kind == "rule":  # the message says on which rank of how many
            raise AssertionError(f"{payload} (this part scores 0)")
        if kind == "error":
            raise AssertionError(f"on {n} ranks: {payload}")
        yield n, payload


def close(got, want, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """got equals want to float32 rounding (the same sums in another order), shape included."""
    return got.shape == want.shape and bool(((got - want).abs() <= atol + rtol * want.abs()).all())


def differ(what: str, got, want: torch.Tensor, versus: str = "one process's", rtol: float = 1e-5,
           atol: float = 1e-5) -> str | None:
    """None when got equals want to fp32 rounding (values of order 1: the same sums, grouped
    differently), else by how much and where it differs."""
    if not isinstance(got, torch.Tensor):
        return f"{what} is {'None' if got is None else 'a ' + type(got).__name__}, want a tensor"
    if got.shape != want.shape:
        return f"{what} has shape {tuple(got.shape)}, want {tuple(want.shape)}"
    got, want = got.detach().double(), want.detach().double()  # exact for every float dtype
    err = (got - want).abs()
    bad = ~(err <= atol + rtol * want.abs())  # nan is bad
    if not bad.any():
        return None
    i = int(torch.where(bad, err.nan_to_num(float("inf")), -1.0).flatten().argmax())
    at = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), want.shape))
    return (f"{what} differs from {versus} by up to {err.max().item():.3g} ({f'at {list(at)}: ' if at else ''}"
            f"got {got[at].item():.6g}, want {want[at].item():.6g})")


def first_problem(problems) -> None:
    """Fail with the first problem (a string) among `problems`; None means no problem."""
    for p in problems:
        if p:
            raise AssertionError(p)
