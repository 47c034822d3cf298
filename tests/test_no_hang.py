"""Nothing hangs (issue 35): every group the mesh makes carries the run's timeout, so a
stopped peer under tp, pp or dp is an error naming the ranks, not a 30-minute wait; the
environment variables that would fail deep inside torch, or never fire, are refused before
any work; the planners' searches are bounded, so a huge batch is answered at once."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from minidist.checkpoint import faults
from minidist.compose import plan_mesh as PM
from minidist.compose.mesh import make_mesh
from minidist.memory import plan as P
from minidist.model import PRESETS, GPTConfig
from minidist.pipeline import exchange
from minidist.run.flags import build_parser, resolve_args

# ---- a stopped peer, on each axis: one group of 2 ranks -------------------------------


def _stopped_peer(done):
    """Rank 0 SIGSTOPs rank 1 once the meshes exist, then waits for it on each axis at once:
    a collective on the tp, dp and pp groups and a pipeline receive. Each must fail within
    the run's timeout (launch's timeout_s, the default group's). Rank 1, woken at the end,
    leaves when `done` appears."""
    # world 2: each a group of both ranks; the pipeline's own (a timed-out message closes its group's pair)
    tp, dp, pp, pipe = make_mesh(tp=2), make_mesh(), make_mesh(pp=2), make_mesh(pp=2)
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 1:
        deadline = time.monotonic() + 120  # (bounded: rank 0 writes `done` in its finally)
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.02)  # where SIGSTOP finds it, and SIGCONT lets it go on
        return None
    os.kill(pids[1], signal.SIGSTOP)
    errors = {}
    try:
        works = {axis: dist.all_reduce(torch.ones(4), group=getattr(m, f"{axis}_group"), async_op=True)
                 for axis, m in (("tp", tp), ("dp", dp), ("pp", pp))}
        try:
            exchange(pipe.pp_group, recvs=[(torch.empty(4), 1)])  # what a stage does for its input
        except Exception as e:  # noqa: BLE001 - the error is the result
            errors["exchange"] = f"{type(e).__name__}: {e}"
        for axis, w in works.items():
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001
                errors[axis] = str(e)
        errors["where"] = tp.where()
    finally:
        os.kill(pids[1], signal.SIGCONT)
        open(done, "w").close()
    return errors


def _pid():
    return os.getpid()


def test_a_stopped_peer_is_an_error_within_the_timeout_on_every_axis(pool, tmp_path):
    # Under the 2 s timeout every rank must reach each group's creation within 2 s of the
    # other. A first call at the pool's timeout imports this module (and what it imports)
    # on both ranks, so the 2 s call spends its time on messages, not on imports that a
    # loaded machine can stretch past 2 s on one rank only.
    pool(2).run(_pid)
    errors, _ = pool(2).run(_stopped_peer, str(tmp_path / "done"), timeout_s=2, deadline_s=120)
    # gloo's own words carry the group's timeout: the run's 2 s, not torch's 30 minutes
    for axis in ("tp", "dp", "pp"):
        assert "Timed out waiting 2000ms" in errors[axis], (axis, errors[axis])
    assert errors["exchange"] == ("TimeoutError: pipeline: rank 0 could not receive from rank 1 in its pp group "
                                  "[0, 1] within 2s: timed out (is that rank stopped?)")
    assert errors["where"] == "rank 0 of dp 1 x tp 2 x pp 1 (tp group [0, 1], dp group [0], pp group [0])"


# ---- the environment, refused before any work ---------------------------------------

BAD_ENV = [  # (variable, value, extra flags), what the one line must say
    ("MINIDIST_TIMEOUT", "1e300", [], "MINIDIST_TIMEOUT='1e300': use a finite number of seconds > 0, from 1 to 604800"),
    ("MINIDIST_TIMEOUT", "0.001", [], "MINIDIST_TIMEOUT='0.001': use a finite number of seconds > 0, from 1 to"),
    ("MINIDIST_TIMEOUT", "604801", [], "from 1 to 604800 (7 days)"),
    ("MINIDIST_FAULT", "kill:step:3:2", [], "MINIDIST_FAULT='kill:step:3:2': rank 2 does not exist in a world of 2"),
    ("MINIDIST_FAULT", "kill:step:11:1", [], "step 11 is not a step of this run (1 to --steps 10)"),
    ("MINIDIST_FAULT", "kill:step:0:0", [], "step 0 is not a step of this run"),
    ("MINIDIST_FAULT", "kill:save:4:1", [], "nothing is saved without --checkpoint-every"),
    ("MINIDIST_FAULT", "kill:save:3:1", ["--checkpoint-every", "2"],
     "step 3 is not saved (only multiples of --checkpoint-every 2, and 10)"),
]


@pytest.mark.parametrize("name, value, argv, says", BAD_ENV, ids=[f"{n}={v}" for n, v, _, _ in BAD_ENV])
def test_environment_no_run_can_use_is_refused_up_front(name, value, argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    base = ["--device", "cpu", "--steps", "10", "--warmup-steps", "2", "--batch-size", "4",
            "--out-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        resolve_args(build_parser().parse_args(base + argv), 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and says in err[-1], err
    assert not (tmp_path / "out").exists()  # before any work


def test_faults_this_run_meets_are_kept():
    assert faults.check_fault("kill:step:10:1", 2, 10) == ("step", 10, 1)
    assert faults.check_fault("kill:save:10:0", 2, 10, 4) == ("save", 10, 0)  # the last step is saved
    assert faults.check_fault("kill:save:8:1", 2, 10, 4) == ("save", 8, 1)
    assert faults.check_fault("", 2, 10) is None


# ---- the planners: bounded searches --------------------------------------------------

TINY = GPTConfig(**PRESETS["tiny"])
MOST = 14414400  # 2^6 3^2 5^2 7 11 13: below MAX_COUNT, with 504 divisors, more than most


def test_a_batch_beyond_any_run_is_refused_by_every_planner():
    for call in (lambda b: P.plan(TINY, b, 64, 1, 4.0), lambda b: PM.plan_mesh(TINY, b, 64, 2, 4.0),
                 lambda b: PM.plan_on_mesh(TINY, b, 64, 1, 2, 1, 4.0)):
        with pytest.raises(P.PlanError, match="the batch must be at most 16,777,216, got 1,000,000,000: .*"
                                              "use a smaller --batch-size"):
            call(10**9)


def test_the_largest_batches_are_planned_in_a_bounded_number_of_evaluations(monkeypatch):
    assert P.divisors(MOST)[:6] == [1, 2, 3, 4, 5, 6] and len(P.divisors(MOST)) == 504
    assert all(P.divisors(n) == [k for k in range(1, n + 1) if n % k == 0] for n in range(1, 200))
    seen = []  # chapter 09's search bisects each family's micro-steps: a few evaluations each
    monkeypatch.setattr(P, "evaluate", lambda *a, _f=P.evaluate: seen.append(a) or _f(*a))
    P.plan(TINY, MOST, 64, 4, 4.0)
    PM.plan_on_mesh(TINY, MOST, 64, 2, 2, 1, 4.0)
    PM.plan_on_mesh(TINY, MOST, 64, 2, 1, 2, 4.0)
    PM.plan_mesh(TINY, 2**24, 64, 4, 4.0)
    assert len(seen) <= 8 * (10 + 2)  # 8 families: a bisection of 504 (<= 10 evaluations), 2 more
