"""Processes, ranks and process groups: the ground every other module stands on.
Chapter 02 (chapters/02_collectives.md) explains it; chapter 01's training run uses it.
Exercised by `torchrun --standalone --nproc_per_node=2 minidist/train_gpt.py` and by
tests/test_dist.py.

`init()` sets up a process group under torchrun (or plain `python`, as world size 1);
minidist/run/launch.py starts processes from a test or notebook. The backend follows the
hardware (NCCL with a GPU per process, else gloo), and every group gets a timeout, so a
peer that never joins a collective is an error, not a hang.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)  # below 1 s torch's rendezvous fails; past days, timedelta overflows


def default_timeout_s(default: float = 300.0) -> float:
    """Seconds a collective may wait for its peers: MINIDIST_TIMEOUT, else `default`, read
    when asked (not at import). Anything but a finite number of seconds in TIMEOUT_RANGE_S
    is a ValueError that names the variable and the range, rather than a failure deep
    inside init (an overflow, torch's rendezvous) or a wait forever."""
    raw = os.environ.get("MINIDIST_TIMEOUT", "").strip()
    if not raw:  # unset or empty: the default
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    low, high = TIMEOUT_RANGE_S
    if not (math.isfinite(seconds) and low <= seconds <= high):
        raise ValueError(f"MINIDIST_TIMEOUT={raw!r}: use a finite number of seconds > 0, from {low:g} to "
                         f"{high:g} (7 days), e.g. MINIDIST_TIMEOUT=600, or unset it (the default is {default:g})")
    return seconds


def group_timeout() -> timedelta:
    """The run's timeout: the default group's, as init() or launch gave it (MINIDIST_TIMEOUT
    without a group). Every group minidist makes, and every point-to-point wait, takes it:
    torch's new_group would otherwise wait its own default, 30 minutes on gloo."""
    if dist.is_available() and dist.is_initialized():
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        try:  # (torch keeps it in the backend's options; no public getter)
            return dist.group.WORLD._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            pass
    return timedelta(seconds=default_timeout_s())


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """WORLD_SIZE, which torchrun sets (1 without it); ValueError naming it otherwise."""
    raw = os.environ.get("WORLD_SIZE", "1")
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"WORLD_SIZE={raw!r} is not an integer >= 1: it is torchrun's to set; "
                         "unset it to run one process, or start the run with torchrun")
    if int(raw) > 1 and "RANK" not in os.environ:  # a leftover: this process would run alone
        raise ValueError(f"WORLD_SIZE={raw} is set but RANK is not: start the run with torchrun "
                         "(which sets both), or unset WORLD_SIZE to run one process")
    return int(raw)


def env_device() -> str | None:
    """MINIDIST_DEVICE ("cpu" or "cuda"; unset or empty: None, pick by what is there)."""
    device = os.environ.get("MINIDIST_DEVICE", "").strip() or None
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"MINIDIST_DEVICE={device!r} is not 'cpu' or 'cuda': set one of them, or unset it "
                         "to use a GPU when there is one")
    return device


def pick_backend(local_world_size: int = 1, device: str | None = None) -> tuple[str, str]:
    """(backend, device type): nccl+cuda when each local process can have its own GPU."""
    if device is None:
        device = env_device() or (
            "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
            else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but CUDA is not available; use --device cpu")
    return ("nccl" if device == "cuda" else "gloo"), device


def _info(device_type: str) -> DistInfo:
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    return DistInfo(rank, local_rank, world, local_world, device, dist.get_backend())


def set_threads(device_type: str, local_world: int) -> None:
    # Processes on one CPU share its cores; more threads than cores only adds contention.
    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def _elastic_store(timeout: timedelta) -> dist.Store:
    """torchrun's rendezvous store, with a prefix per attempt: after a restart the store
    may still hold the dead workers' gloo addresses, which a new worker could read."""
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), timeout=timeout,
                          is_master=not agent_hosts and os.environ["RANK"] == "0")
    return dist.PrefixStore(f"minidist/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def init(device: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Join (or create) the process group this process belongs to and return who we are.
    Under torchrun the rendezvous comes from its environment; without it this is a group of
    one, so the same code runs as plain `python`. Calling init() again returns the same info.
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if dist.is_initialized():
        return _info("cuda" if dist.get_backend() == "nccl" else "cpu")
    backend, device_type = pick_backend(local_world, device)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    set_threads(device_type, local_world)
    timeout = timedelta(seconds=default_timeout_s() if timeout_s is None else timeout_s)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # torchrun
        dist.init_process_group(backend, store=_elastic_store(timeout), timeout=timeout,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)  # env:// from another launcher
    else:
        # No launcher: a world of one. A HashStore needs no network port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return _info(device_type)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) when there is none."""
    on = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(), dist.get_world_size()) if on else (0, 1)


def barrier_or_failure(failed: str | None = None) -> str | None:
    """A barrier that also tells every rank whether one of them failed, and which (pass
    what went wrong here, or None), so no rank waits for a failed one until the timeout."""
    rank, world = rank_and_world()
    if world == 1:
        return failed
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
    flag = torch.tensor([rank if failed else world], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # the lowest failed rank, or world: none
    return failed or (f"rank {int(flag)} failed" if int(flag) < world else None)
