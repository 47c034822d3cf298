"""Exercise 02's grader catches the classic mistakes of a ring all-reduce, each in the
check it belongs to, and a ring that hangs fails its checks instead of hanging the grader.

(tests/test_exercises.py proves for every exercise that the stubs score 0 and minidist
scores full.) Each mistake runs on 3 ranks only, the smallest world where a ring going
the wrong way differs from one going the right way; the grader itself runs 2, 3 and 4.
The mistaken functions live at module level: cloudpickle ships them to the ranks by name.
"""

import time

import pytest
import torch
import torch.distributed as dist

from exercises import checks_02 as C
from exercises import grade as G

ref_rs, ref_ag = C.reference_ring_reduce_scatter, C.reference_ring_all_gather


def _sendrecv(send, dst, recv, src):
    works = [dist.irecv(recv, src), dist.isend(send, dst)]
    for w in works:
        w.wait()


def _all_reduce_via(tensor, reduce_scatter, all_gather):
    chunks = list(torch.tensor_split(tensor.view(-1), dist.get_world_size()))
    reduce_scatter(chunks)
    all_gather(chunks)
    return tensor


# -- 0. a plain solution, written the way the exercise asks: full marks

def rs_plain(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        acc = chunks[(r - k - 2) % n]
        buf = torch.empty_like(acc)
        _sendrecv(chunks[(r - k - 1) % n], (r + 1) % n, buf, (r - 1) % n)
        acc.add_(buf)


def ag_plain(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        _sendrecv(chunks[(r - k) % n], (r + 1) % n, chunks[(r - k - 1) % n], (r - 1) % n)


def ar_plain(tensor):
    return _all_reduce_via(tensor, rs_plain, ag_plain)


# -- 1. the last reduce-scatter step stores the received partial sum instead of adding to it

def rs_copies_on_last_step(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        acc = chunks[(r - k - 2) % n]
        buf = torch.empty_like(acc)
        _sendrecv(chunks[(r - k - 1) % n], (r + 1) % n, buf, (r - 1) % n)
        if k < n - 2:
            acc.add_(buf)
        else:
            acc.copy_(buf)  # the mistake: this rank's own contribution is lost


def ar_copies_on_last_step(tensor):
    return _all_reduce_via(tensor, rs_copies_on_last_step, ref_ag)


# -- 2. the ring turned around (send left, receive from the right), indices left as they
#       were: sends meet receives of other sizes, and gloo aborts the rank

def rs_wrong_neighbour(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        acc = chunks[(r - k - 2) % n]
        buf = torch.empty_like(acc)
        _sendrecv(chunks[(r - k - 1) % n], (r - 1) % n, buf, (r + 1) % n)
        acc.add_(buf)


def ag_wrong_neighbour(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        _sendrecv(chunks[(r - k) % n], (r - 1) % n, chunks[(r - k - 1) % n], (r + 1) % n)


def ar_wrong_neighbour(tensor):
    return _all_reduce_via(tensor, rs_wrong_neighbour, ag_wrong_neighbour)


# -- 2b. the mirror image: a correct ring going left. Right numbers, but not the ring asked
#        for (and in chapter 03 the direction matters), so the byte count says so

def rs_mirrored(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        acc = chunks[(r + k + 2) % n]
        buf = torch.empty_like(acc)
        _sendrecv(chunks[(r + k + 1) % n], (r - 1) % n, buf, (r + 1) % n)
        acc.add_(buf)


def ag_mirrored(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        _sendrecv(chunks[(r + k) % n], (r - 1) % n, chunks[(r + k + 1) % n], (r + 1) % n)


def ar_mirrored(tensor):
    return _all_reduce_via(tensor, rs_mirrored, ag_mirrored)


# -- 3. torch's all_reduce: right numbers, wrong exercise

def ar_torch(tensor):
    dist.all_reduce(tensor)
    return tensor


# -- 3b. collectives dressed as the two halves: all_reduce per chunk, broadcast to gather.
#        Right numbers, no ring: every part that runs them scores 0, naming the API

def rs_all_reduce_per_chunk(chunks):
    for c in chunks:
        dist.all_reduce(c)


def ag_broadcast(chunks):
    for i, c in enumerate(chunks):
        dist.broadcast(c, src=i)


def ar_collectives(tensor):
    return _all_reduce_via(tensor, rs_all_reduce_per_chunk, ag_broadcast)


# -- 4. everything to rank 0 and back: point-to-point and right, but rank 0 sends (N-1)*S

def ar_through_rank_0(tensor):
    r, n = dist.get_rank(), dist.get_world_size()
    if r == 0:
        buf = torch.empty_like(tensor)
        for src in range(1, n):
            dist.recv(buf, src)
            tensor.add_(buf)
        for dst in range(1, n):
            dist.send(tensor, dst)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
    return tensor


# -- 5. blocking send before receive: every rank waits for a receiver that is sending too

def ag_blocking_send_first(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        dist.send(chunks[(r - k) % n], (r + 1) % n)
        dist.recv(chunks[(r - k - 1) % n], (r - 1) % n)


# -- 6. polling a receive that never completes: no gloo timeout would ever see it

def ar_polls_forever(tensor):
    r, n = dist.get_rank(), dist.get_world_size()
    work = dist.irecv(torch.empty(1), (r + 1) % n)  # nobody sends it
    while not work.is_completed():
        time.sleep(0.01)
    return tensor


# The checks, by a word of their names.
CHECK = {"rs": "ring_reduce_scatter", "ag": "ring_all_gather", "fp32": "all_reduce float32",
         "bf16": "all_reduce bfloat16", "p2p": "isend/irecv", "ring": "is a ring"}

MISTAKES = {
    # name: (overrides, checks that must fail, a phrase each failure message contains)
    "no add on the last step": (  # the ring's run checks the sum too
        dict(ring_reduce_scatter=rs_copies_on_last_step, all_reduce=ar_copies_on_last_step),
        {"rs", "fp32", "bf16", "ring"}, "the sum over ranks is"),
    "sends to the left, indices unchanged": (
        dict(ring_reduce_scatter=rs_wrong_neighbour, ring_all_gather=ag_wrong_neighbour,
             all_reduce=ar_wrong_neighbour),
        set(CHECK), "a send met the wrong receive"),
    "a ring going left": (  # the direction is a rule of every part
        dict(ring_reduce_scatter=rs_mirrored, ring_all_gather=ag_mirrored, all_reduce=ar_mirrored),
        set(CHECK), "sends only to its right neighbour"),
    "dist.all_reduce": (dict(all_reduce=ar_torch), {"fp32", "bf16", "p2p", "ring"},
                        "dist.all_reduce (ProcessGroup.allreduce) was called, which this exercise forbids"),
    "all_reduce per chunk, broadcast": (
        dict(ring_reduce_scatter=rs_all_reduce_per_chunk, ring_all_gather=ag_broadcast,
             all_reduce=ar_collectives),
        set(CHECK), "which this exercise forbids: only dist.isend/irecv/send/recv"),
    "through rank 0": (dict(all_reduce=ar_through_rank_0), {"fp32", "bf16", "p2p", "ring"},
                       "sends only to its right neighbour"),
}


def _failed(result):
    failed = {c.name: c.message for c in result.checks if not c.ok}
    return {k for k, v in CHECK.items() if any(v in name for name in failed)}, failed


@pytest.fixture
def three_ranks(monkeypatch):
    monkeypatch.setattr(C, "WORLD_SIZES", (3,))


def test_a_plain_solution_scores_full(three_ranks):
    r = G.grade("02", overrides=dict(ring_reduce_scatter=rs_plain, ring_all_gather=ag_plain,
                                     all_reduce=ar_plain))
    assert r.points == r.max_points, {c.name: c.message for c in r.checks if not c.ok}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistake_loses_the_points_of_its_checks(mistake, three_ranks):
    overrides, must_fail, phrase = MISTAKES[mistake]
    r = G.grade("02", reference=True, overrides=overrides)
    which, messages = _failed(r)
    assert which == must_fail, messages
    assert r.points == sum(c.points for c in r.checks if c.ok) < r.max_points
    for name, msg in messages.items():
        assert phrase in msg and "not implemented" not in msg, (name, msg)


def test_a_deadlock_and_an_endless_loop_fail_their_checks_within_the_timeout(three_ranks, monkeypatch):
    """One grading, two kinds of hang (one timeout each, not two gradings): the ring
    all-gather deadlocks (every rank's blocking send waits for a receive nobody posts), and
    the all-reduce polls forever without any collective."""
    # the one part that must finish in time (the reduce-scatter) takes 0.2 s, under 1 s
    # on a 2-core machine running 8 busy processes
    monkeypatch.setattr(C, "TIMEOUT_S", 4.0)  # 4x the worst seen
    overrides = dict(ring_all_gather=ag_blocking_send_first, all_reduce=ar_polls_forever)
    r = G.grade("02", reference=True, overrides=overrides)
    which, messages = _failed(r)
    # reduce-scatter still earns its points; the rest hang, so fail, saying why
    assert which == {"ag", "fp32", "bf16", "p2p", "ring"}, messages
    assert all("timed out" in m for m in messages.values()), messages
    assert "deadlocked" in messages[next(n for n in messages if CHECK["ag"] in n)], messages
    assert all("still running after 4s" in m for n, m in messages.items() if CHECK["ag"] not in n), messages
    # (the hangs were stopped by the grader's watchdog: a hang it missed would never end,
    # so finishing at all, with "timed out" in every failed check, is the proof)


def test_results_are_cached_per_implementation(three_ranks, monkeypatch):
    runs = []
    real = C._run_all
    monkeypatch.setattr(C, "_run_all", lambda fns: runs.append(fns) or real(fns))
    G.grade("02", reference=True)
    G.grade("02", reference=True)  # the same functions: no new launch
    assert len(runs) == 1
    G.grade("02", reference=True, overrides=dict(all_reduce=ar_torch))
    assert len(runs) == 2


def test_hints_come_in_order_for_the_first_failing_check(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIDIST_HINT_STATE", str(tmp_path / "hints.json"))
    # a graded result whose first failing check is the reduce-scatter (no processes needed)
    checks = G.checks_of("02")
    result = G.Result("02", "02_collectives", [G.CheckResult(c.name, False, 0, c.points, "x")
                                                for c in checks])
    want = C.HINTS["_reduce_scatter"]
    shown = [G.hint(result) for _ in range(len(want) + 1)]
    for k, text in enumerate(shown[:len(want)], 1):
        assert text.startswith(f"Hint {k} of {len(want)}"), text
        assert " ".join(want[k - 1].split()[:6]) in " ".join(text.split()), text
    assert shown[-1].startswith(f"Hint {len(want)} of {len(want)}")  # stays on the last
    assert G.hint(result, 1).startswith("Hint 1 of")  # --hint K: that one
    assert "hints 1 to" in G.hint(result, 99)
    passed = G.Result("02", "02_collectives", [G.CheckResult(c.name, True, c.points, c.points)
                                               for c in checks])
    assert "no hint needed" in G.hint(passed)
    # every check of the exercise has hints
    assert all(G.hints_of("02", c) for c in checks)
