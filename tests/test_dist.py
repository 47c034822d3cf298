"""minidist.dist: init() without torchrun, and launch(): return values, failures re-raised
with their rank, a dead child reported, a peer that never joins a collective turning into
an error within the timeout, and functions defined in a notebook. Then Pool: the same
contract on processes that stay alive, each call starting from a fresh process's state,
and a failed call that leaves nothing behind for the next."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from minidist.dist import init
from minidist.launch import LaunchError, launch
from minidist.run.pool import Pool


def _who_and_sum(offset):
    info = init()  # inside launch: returns the group launch made
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    return info.rank, info.world_size, info.backend, t.item() + offset


@pytest.mark.parametrize("world", [1, 2, 3])
def test_launch_returns_each_ranks_value(world):
    out = launch(_who_and_sum, world, 0.5)
    # sum of 1..world, computed here independently of the processes
    assert out == [(r, world, "gloo", world * (world + 1) / 2 + 0.5) for r in range(world)]


def _fails_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("bad thing")
    return "fine"


def test_child_exception_reraised_with_rank():
    with pytest.raises(ValueError, match=r"\[rank 1 of 2\] bad thing") as e:
        launch(_fails_on_rank_one, 2)
    assert e.value.rank == 1
    assert "_fails_on_rank_one" in str(e.value.__cause__)  # the child's traceback


def _dies_silently():
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()


def test_child_that_dies_without_a_word_is_reported():
    with pytest.raises(LaunchError, match="rank 1 of 2 exited with code 7"):
        launch(_dies_silently, 2, timeout_s=30)


def _skips_collective(woke):
    if dist.get_rank() == 1:
        time.sleep(120)  # alive, but never joins
        open(woke, "w").close()  # only reached if nobody stopped this rank
        return None
    dist.all_reduce(torch.ones(4))


def test_missing_peer_is_an_error_not_a_hang(tmp_path):
    woke = tmp_path / "woke"
    with pytest.raises(Exception, match=r"rank 0 of 2"):
        launch(_skips_collective, 2, str(woke), timeout_s=2)
    assert not woke.exists()  # the error came before the sleeping peer woke: no waiting on it


def test_init_without_torchrun_is_a_world_of_one(python):
    code = ("import torch, torch.distributed as dist; from minidist.dist import init; "
            "i = init(); t = torch.ones(2); dist.all_reduce(t); "
            "print(i.rank, i.world_size, i.backend, i.device, t.tolist())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "1", "gloo", "cpu", "[1.0,", "1.0]"]


def _spins_forever():
    while True:
        time.sleep(0.05)


def test_deadline_stops_a_run_that_never_ends():
    with pytest.raises(LaunchError, match="still running after the deadline of 1s"):
        launch(_spins_forever, 2, deadline_s=1)
    # the ranks spin forever: that launch returned at all is the deadline's doing


@pytest.mark.parametrize("world_size, kw, says", [
    (0, {}, "world_size must be an integer >= 1, got 0"), (2.5, {}, "got 2.5"), ("2", {}, "got '2'"),
    (2, {"timeout_s": 0}, "timeout_s must be a finite number of seconds > 0"),
    (2, {"deadline_s": -1}, "deadline_s must be a finite number of seconds > 0 or None"),
    (2, {"grace_s": float("nan")}, "grace_s must be a finite number of seconds >= 0")])
def test_bad_arguments_are_refused_before_any_process_starts(world_size, kw, says):
    with pytest.raises(ValueError, match=says):
        launch(_who_and_sum, world_size, 0.0, **kw)


def _exits(code):
    sys.exit(code)


def test_a_rank_that_exits_is_a_launch_error_not_the_callers_exit():
    with pytest.raises(LaunchError, match=r"rank [01] of 2 failed: SystemExit: bye"):
        launch(_exits, 2, "bye")


# Launching a function defined in a notebook cell (it lives in the kernel's __main__, which
# a spawned child cannot import: launch ships it by value, with the globals it uses) is
# what every notebook does: tests/test_frames.py runs them all.


# -- Pool: launch's contract, on processes that serve many calls

def _leave_a_mess(seed):
    """What a careless call might change: the RNG, the environment, the threads, the group."""
    torch.manual_seed(seed)
    os.environ["MINIDIST_FAULT"] = "kill:step:1:0"
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.destroy_process_group()  # as train_gpt.main does at its end
    return os.getpid()


def _what_a_call_sees():
    t = torch.ones(1)
    dist.all_reduce(t)
    return (os.getpid(), torch.get_rng_state(), os.environ.get("MINIDIST_FAULT"),
            torch.get_num_threads(), torch.get_default_dtype(), t.item())


def test_pool_serves_calls_on_the_same_processes_each_from_a_fresh_state():
    with Pool(2, timeout_s=30) as pool:
        first = pool.run(_what_a_call_sees)
        pids = pool.run(_leave_a_mess, 7)
        after = pool.run(_what_a_call_sees)
        assert pool.starts == 1
    assert [f[0] for f in first] == pids == [a[0] for a in after]  # no new processes
    for f, a in zip(first, after):
        assert torch.equal(f[1], a[1])  # the RNG state the processes started with
        assert f[2:] == a[2:] and a[2] is None and a[4] == torch.float32 and a[5] == 2.0


def test_pool_failure_is_reraised_with_rank_and_the_next_call_gets_fresh_processes():
    with Pool(2, timeout_s=30) as pool:
        assert [r for r, *_ in pool.run(_who_and_sum, 0.0)] == [0, 1]
        with pytest.raises(ValueError, match=r"\[rank 1 of 2\] bad thing") as e:
            pool.run(_fails_on_rank_one)
        assert e.value.rank == 1 and "_fails_on_rank_one" in str(e.value.__cause__)
        with pytest.raises(LaunchError, match="still running after the deadline of 1s"):
            pool.run(_spins_forever, deadline_s=1)  # (it spins forever: returning is the proof)
        assert pool.run(_who_and_sum, 0.5) == [(r, 2, "gloo", 3.5) for r in range(2)]
        assert pool.starts == 3  # one start, and a fresh one after each failure


def test_pool_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        Pool(0)
