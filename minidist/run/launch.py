"""launch(fn, world_size, *args): run a function in N local processes, each in one
process group, from a test, a notebook or an exercise. Chapter 02
(chapters/02_collectives.md). Exercised by tests/test_dist.py and every notebook, through
its public name minidist.launch: `python -c "from minidist.launch import launch; print(launch(abs, 2, -1))"`.

It does torchrun's job inside one Python call. The backend follows where the function's
tensors live, which only the caller knows: gloo and CPU tensors unless a GPU run is asked
(device="cuda", backend="nccl", or device="auto" when every rank can have its own GPU).
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import queue
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minidist.dist import set_threads, pick_backend


class LaunchError(RuntimeError):
    """A launched process failed in a way that could not be re-raised as itself."""


class RemoteTraceback(Exception):
    """Carries a child's traceback text, shown as the cause of the re-raised exception."""

    def __str__(self) -> str:
        return self.args[0]


def dumps(obj) -> bytes:
    # cloudpickle ships functions defined in __main__ (a script or a notebook cell) by
    # value; plain pickle could only name them, and a spawned child cannot import a
    # notebook. Everything the function refers to must itself be picklable.
    import cloudpickle
    return cloudpickle.dumps(obj)


def _child(rank, world_size, port, backend, device_type, timeout_s, payload, results,
           tasks=None, caller=None):
    """One process of a group: join it, then run `payload` (launch) or, for a Pool, each
    payload that arrives on `tasks` until None does."""
    if caller is not None:  # forked from the fork server: take the caller's place
        env, path, cwd = caller
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        os.chdir(cwd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        set_threads(device_type, world_size)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        if tasks is None:
            _join(backend, store, rank, world_size, timeout_s)
    except BaseException as e:  # noqa: BLE001 - a failed start is reported like a failed call
        results.put((rank, "error", _failure(e)))
        return
    if tasks is None:
        _run_one(rank, payload, results)
    else:
        fresh, calls = _state(), 0
        while (task := tasks.get()) is not None:
            payload, call_timeout_s = task
            _restore(*fresh)  # each call starts from the state of a fresh process
            calls += 1
            _run_one(rank, payload, results, lambda: _join(
                backend, dist.PrefixStore(f"call_{calls}", store), rank, world_size, call_timeout_s))


def _join(backend, store, rank, world_size, timeout_s):
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _run_one(rank, payload, results, join=None):
    try:
        if join is not None:
            join()
        fn, args = pickle.loads(payload)
        outcome = ("ok", dumps(fn(*args)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        # reported before this rank leaves the group: its peers' errors ("connection
        # closed") are consequences and must not arrive first
        results.put((rank, "error", _failure(e)))
        outcome = None
    if dist.is_initialized():
        # A Pool's call gets its own group (milliseconds, where a process start takes
        # seconds): a message it left unreceived dies with it. Every rank leaves before it
        # reports success, so none is still in this group when the next call forms one.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if outcome is not None:
        results.put((rank, *outcome))


def _failure(e: BaseException) -> tuple:
    """(the pickled exception or None, its traceback, its text); called in `except`."""
    tb = traceback.format_exc()
    try:
        blob = dumps(e)
    except Exception:  # an exception that will not pickle still reports its text
        blob = None
    return blob, tb, f"{type(e).__name__}: {e}"


def _state():
    # What a Pool's call could change and the next inherit, were it not put back: the RNG
    # (no call's draws depend on the calls before it), the environment (MINIDIST_FAULT...)
    return (torch.get_rng_state(), dict(os.environ), torch.get_num_threads(),
            torch.get_default_dtype())


def _restore(rng, env, threads, dtype):
    torch.set_rng_state(rng)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)


def _reraise(rank: int, world_size: int, info):
    blob, tb, text = info
    exc = pickle.loads(blob) if blob is not None else None
    where = f"rank {rank} of {world_size}"
    if not isinstance(exc, Exception):  # SystemExit, KeyboardInterrupt: a rank's, not the caller's
        exc = None
    if exc is not None and exc.args and isinstance(exc.args[0], str):
        exc.args = (f"[{where}] {exc.args[0]}",) + exc.args[1:]
    else:
        exc = LaunchError(f"{where} failed: {text}")
    exc.rank = rank
    raise exc from RemoteTraceback(f"\n\nTraceback on {where}:\n{tb}")


def check_times(timeout_s, grace_s, deadline_s) -> None:
    """ValueError unless the time limits of a launch or a Pool can mean something."""
    for name, v, none_ok in (("timeout_s", timeout_s, False), ("grace_s", grace_s, False),
                             ("deadline_s", deadline_s, True)):
        if v is None and none_ok:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                or (v == 0 and name != "grace_s"):
            raise ValueError(f"{name} must be a finite number of seconds {'>= 0' if name == 'grace_s' else '> 0'}"
                             f"{' or None' if none_ok else ''}, got {v!r}")


def choose_backend(world_size, backend, device):
    """(backend, device type) of a launch or a Pool: gloo on CPU unless asked (NCCL takes
    only CUDA tensors); device="cuda" or backend="nccl": NCCL, a GPU per rank; "auto":
    NCCL when every rank can have its own GPU (or MINIDIST_DEVICE says so), else gloo."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if device not in (None, "cpu", "cuda", "auto"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if backend is not None:
        implied = "cuda" if backend == "nccl" else "cpu"
        if device not in (None, "auto", implied):
            raise ValueError(f"backend={backend!r} takes {implied} tensors, not {device}: "
                             f"drop one of backend= and device=")
        device = implied
    if device is None:
        device = "cpu"
    return pick_backend(world_size, None if device == "auto" else device)


def _context():
    """A fork server (one clean process that imported torch once) forks each child in
    milliseconds, without the caller's threads and CUDA state; spawn where there is none.
    It imports torch._dynamo too: torch.optim's methods import it on their first call (a
    second or more per rank, in every rank of every launch), so it is imported once here."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    return ctx


def start_ranks(world_size, backend, device_type, timeout_s, payload, pooled):
    """(store, processes, results queue, task queues or None): a group of fresh processes."""
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    results = ctx.Queue()
    tasks = [ctx.SimpleQueue() for _ in range(world_size)] if pooled else None
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(r, world_size, store.port, backend, device_type, timeout_s,
                               payload, results, tasks[r] if pooled else None,
                               (dict(os.environ), list(sys.path), os.getcwd())))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return store, procs, results, tasks


def collect_results(procs, results, grace_s, deadline_s):
    """Wait for one result from every rank: (outputs by rank, the first failure or None).
    A failure is (rank, "error", info) | (rank, "died", exit code) | (rank, "deadline", s)."""
    world_size = len(procs)
    outputs, failure, failed_at, reported = {}, None, None, set()
    t_end = None if deadline_s is None else time.monotonic() + deadline_s
    while len(outputs) < world_size:
        if failure is not None and time.monotonic() - failed_at > grace_s:
            break
        if t_end is not None and time.monotonic() > t_end and failure is None:
            late = [r for r in range(world_size) if r not in outputs]
            return outputs, (late[0], "deadline", deadline_s)
        try:
            rank, status, blob = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if p.exitcode is not None and r not in outputs]
            if dead and failure is None:
                time.sleep(0.5)  # its report may still be in the queue
                if results.empty():
                    failure = (dead[0], "died", procs[dead[0]].exitcode)
                    failed_at = time.monotonic()
            continue
        if status == "ok":
            outputs[rank] = pickle.loads(blob)
        elif failure is None or failure[1] == "died":
            failure, failed_at = (rank, status, blob), time.monotonic()
        else:
            outputs[rank] = None  # a later failure, most likely a consequence
        reported.add(rank)
    # A child that died without a report is the likeliest root cause: the others'
    # errors ("connection closed by peer") are usually its consequence.
    silent = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported]
    if silent:
        failure = (silent[0], "died", procs[silent[0]].exitcode)
    return outputs, failure


def stop_ranks(procs, results, wait_s):
    for p in procs:
        p.join(timeout=wait_s)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
    results.close()


def raise_failure(failure, world_size):
    rank, status, info = failure
    if status == "deadline":
        raise LaunchError(f"rank {rank} of {world_size} was still running after the "
                          f"deadline of {info:.0f}s and was stopped")
    if status == "died":
        hint = ("killed, out of memory, or os._exit?" if info != 1 else "its stderr above says why; "
                "from a script, call launch under `if __name__ == \"__main__\":`, since each rank "
                "imports the script again")
        raise LaunchError(f"rank {rank} of {world_size} exited with code {info} without "
                          f"reporting an error ({hint})")
    _reraise(rank, world_size, info)


def launch(fn, world_size: int, *args, backend: str | None = None, device: str | None = None,
           timeout_s: float = 120.0, grace_s: float = 1.0, deadline_s: float | None = None):
    """Run fn(*args) in `world_size` new processes, each in one process group; return
    the list of return values, indexed by rank. Each call makes a fresh rendezvous (a
    TCPStore on a port the OS picks). A process that raises is re-raised here with
    "[rank r of N]" before its message and its traceback as the cause; the others get
    `grace_s` seconds, then are stopped. `fn` may be defined in a notebook; the children's
    prints go to the terminal, not the notebook. `timeout_s` bounds each collective and the
    rendezvous; `deadline_s`, if given, the whole call (LaunchError past it)."""
    backend, device_type = choose_backend(world_size, backend, device)
    check_times(timeout_s, grace_s, deadline_s)
    store, procs, results, _ = start_ranks(world_size, backend, device_type, timeout_s,
                                           dumps((fn, args)), pooled=False)
    failure = None
    try:
        outputs, failure = collect_results(procs, results, grace_s, deadline_s)
    finally:
        stop_ranks(procs, results, 0 if failure else 10)
    if failure is not None:
        raise_failure(failure, world_size)
    return [outputs[r] for r in range(world_size)]
