"""launch(fn, world_size, *args): run a function in N local processes, each in one
process group, from a test, a notebook or an exercise.

Chapter 02 (chapters/02_collectives.md) introduces it. Exercised by tests/test_dist.py and
every notebook: `python -c "from minidist.launch import launch; print(launch(abs, 2, -1))"`.

A program started by torchrun does not need this: torchrun starts the processes and
`minidist.dist.init()` joins them. launch does torchrun's job inside one Python call:
it starts `world_size` processes, gives each the environment torchrun would, sets up the
process group, runs `fn(*args)` there and hands back the return values, or re-raises the
first failure with its rank.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minidist.dist import _set_threads, pick_backend


class LaunchError(RuntimeError):
    """A launched process failed in a way that could not be re-raised as itself."""


class RemoteTraceback(Exception):
    """Carries a child's traceback text, shown as the cause of the re-raised exception."""

    def __str__(self) -> str:
        return self.args[0]


def _dumps(obj) -> bytes:
    # cloudpickle ships functions defined in __main__ (a script or a notebook cell) by
    # value; plain pickle could only name them, and a spawned child cannot import a
    # notebook. Everything the function refers to must itself be picklable.
    import cloudpickle
    return cloudpickle.dumps(obj)


def _child(rank, world_size, port, backend, device_type, timeout_s, payload, results):
    import pickle
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        _set_threads(device_type, world_size)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        fn, args = pickle.loads(payload)
        out = fn(*args)
        results.put((rank, "ok", _dumps(out)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        try:
            blob = _dumps(e)
        except Exception:  # an exception that will not pickle still reports its text
            blob = None
        results.put((rank, "error", (blob, tb, f"{type(e).__name__}: {e}")))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _reraise(rank: int, world_size: int, info):
    import pickle
    blob, tb, text = info
    exc = pickle.loads(blob) if blob is not None else None
    where = f"rank {rank} of {world_size}"
    if exc is not None and exc.args and isinstance(exc.args[0], str):
        exc.args = (f"[{where}] {exc.args[0]}",) + exc.args[1:]
    else:
        exc = LaunchError(f"{where} failed: {text}")
    exc.rank = rank
    raise exc from RemoteTraceback(f"\n\nTraceback on {where}:\n{tb}")


def launch(fn, world_size: int, *args, backend: str | None = None, device: str | None = None,
           timeout_s: float = 120.0, grace_s: float = 1.0, deadline_s: float | None = None):
    """Run fn(*args) in `world_size` new processes, each in one process group; return
    the list of return values, indexed by rank.

    Each call makes a fresh rendezvous: a TCPStore on a port the OS picks, so calls never
    collide. If a process raises, its exception is re-raised here with "[rank r of N]" in
    front of its message and its traceback as the cause; the others get `grace_s` seconds
    to finish, then are stopped. `fn` may be defined in a notebook (see _dumps). Output
    printed by the children goes to the terminal that started Python, which in Jupyter is
    not the notebook: return what you want to show.

    `timeout_s` bounds each collective (and the rendezvous); `deadline_s`, if given, bounds
    the whole call: past it the processes are stopped and LaunchError says so (a loop that
    never ends involves no collective, so only a deadline can catch it).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend is None:
        backend, device_type = pick_backend(world_size, device)
    else:
        device_type = "cuda" if backend == "nccl" else "cpu"
    ctx = mp.get_context("spawn")  # fork would copy the parent's threads and CUDA state
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    results = ctx.Queue()
    payload = _dumps((fn, args))
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(r, world_size, store.port, backend, device_type, timeout_s,
                               payload, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs, failure, failed_at, reported = {}, None, None, set()
    t_end = None if deadline_s is None else time.monotonic() + deadline_s
    try:
        while len(outputs) < world_size:
            if failure is not None and time.monotonic() - failed_at > grace_s:
                break
            if t_end is not None and time.monotonic() > t_end and failure is None:
                late = [r for r in range(world_size) if r not in outputs]
                failure, failed_at = (late[0], "deadline", deadline_s), time.monotonic()
                break
            try:
                rank, status, blob = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in outputs]
                if dead and failure is None:
                    time.sleep(0.5)  # its report may still be in the queue
                    if results.empty():
                        failure = (dead[0], "died", procs[dead[0]].exitcode)
                        failed_at = time.monotonic()
                continue
            if status == "ok":
                import pickle
                outputs[rank] = pickle.loads(blob)
            elif failure is None or failure[1] == "died":
                failure, failed_at = (rank, status, blob), time.monotonic()
            else:
                outputs[rank] = None  # a later failure, most likely a consequence
            reported.add(rank)
        # A child that died without a report is the likeliest root cause: the others'
        # errors ("connection closed by peer") are usually its consequence.
        silent = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported]
        if silent and (failure is None or failure[1] != "deadline"):
            failure = (silent[0], "died", procs[silent[0]].exitcode)
    finally:
        for p in procs:
            p.join(timeout=0 if failure else 10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
        results.close()
    if failure is not None:
        rank, status, info = failure
        if status == "deadline":
            raise LaunchError(f"rank {rank} of {world_size} was still running after the "
                              f"deadline of {info:.0f}s and was stopped")
        if status == "died":
            raise LaunchError(f"rank {rank} of {world_size} exited with code {info} without "
                              "reporting an error (killed, out of memory, or os._exit?)")
        _reraise(rank, world_size, info)
    return [outputs[r] for r in range(world_size)]
