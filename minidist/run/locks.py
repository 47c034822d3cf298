"""One run per output folder: rank 0 of a run locks its --out-dir (acquire_lock) before any
work, and train_gpt's flag checks refuse a folder another live run holds (lock_holder); a
folder another, ended run left its outputs in is cleared for this run, with them moved
aside (take_out_dir).

Chapter 08 (chapters/08_at_scale.md). Exercised by `pytest tests/test_reliability.py -k lock`.

Two runs writing one folder interleave their metrics and prune each other's checkpoints.
Rank 0 holds an flock on OUT/run.lock for its run's whole life; the kernel drops it when
the process ends, however it ends, so a killed run's folder is free again at once.
"""

from __future__ import annotations

import fcntl  # POSIX
import json
import os
import socket
import sys
import time
from pathlib import Path

from minidist.checkpoint.resume import set_aside
from minidist.files import read_bounded

LOCK = "run.lock"


def run_id() -> str | None:
    """What every rank of this run shares and no other run has: torchrun's run id, else the
    rendezvous address; None for one process started by hand."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    if rid and rid != "none":
        return f"torchrun {rid}"
    if os.environ.get("RANK") and os.environ.get("MASTER_PORT"):
        return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}"
    return None


def _lock_info(lock: Path, wait_s: float = 1.0) -> dict:
    """The holder's note in the lock file ({} if it never becomes readable: the holder
    writes it just after taking the lock, so a reader can come in between)."""
    t_end = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads(read_bounded(lock, 1 << 16, "the lock file"))
            if isinstance(info, dict):
                return info
        except (OSError, ValueError):
            pass
        if time.monotonic() > t_end:
            return {}
        time.sleep(0.02)


def lock_holder(out) -> dict | None:
    """The run that holds `out`'s lock, if a live one other than this run does (its note:
    host, pid, command, start); None if none does (a killed run's lock file is left behind,
    but nobody holds the flock)."""
    lock = Path(out) / LOCK
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO would block a plain open)
    except OSError:  # no lock file (or not readable, which the output checks report)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a probe: is anyone holding it?
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        pass
    except OSError:  # a file system without locks: nothing to go by
        return None
    finally:
        os.close(fd)
    info = _lock_info(lock)
    if info.get("run") is not None and info.get("run") == run_id():
        return None  # another rank of this run, or its previous attempt, still letting go
    return info


def in_use_message(out, info: dict) -> str:
    who = (f"pid {info.get('pid', '?')} on {info.get('host', '?')}, since {info.get('started', '?')}: "
           f"{info.get('command', '?')}") if info else "a run that has not said who it is"
    return (f"--out-dir {out} is in use by another run ({who}): wait for it to end (or stop it), "
            "or choose another --out-dir")


class OutDirInUse(RuntimeError):
    """Another live run holds the --out-dir lock."""


def acquire_lock(out, wait_s: float = 2.0):
    """Take `out`'s lock for this run (rank 0 calls it, once, before any work); returns
    what release_lock needs. OutDirInUse if another live run holds it. Waits up to
    `wait_s` while the holder is this run (a previous torchrun attempt exiting)."""
    lock = Path(out) / LOCK
    t_end = time.monotonic() + wait_s
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            info = lock_holder(out)
            if info is not None and (info or time.monotonic() > t_end):
                raise OutDirInUse(in_use_message(out, info)) from None
            if time.monotonic() > t_end:
                raise OutDirInUse(f"--out-dir {out}: {lock} stayed locked for {wait_s:g} s: "
                                  "another run is starting there; choose another --out-dir") from None
            time.sleep(0.05)
            continue
        except OSError as e:  # no locks on this file system: run, and say so
            os.close(fd)
            print(f"warning: {lock} cannot be locked ({e.strerror or e}); nothing stops a second "
                  f"run from writing to {out} at the same time", file=sys.stderr)
            return None
        try:  # a holder that let go may have deleted the file we opened: lock the current one
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        note = {"host": socket.gethostname(), "pid": os.getpid(), "run": run_id(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(note).encode())
        return fd, lock


def release_lock(held) -> None:
    """Let go of the lock (the file is deleted first, so a run waiting on it retries)."""
    if held is None:
        return
    fd, lock = held
    try:
        os.unlink(lock)
    except OSError:
        pass
    os.close(fd)


# ---- the outputs an earlier run left ------------------------------------------------------

OUTPUTS = ("metrics.jsonl", "summary.json")  # what tells a run's story (and loss.png, its plot)
MAX_SUMMARY = 16 << 20  # a summary.json is KBs: the args, the numbers, a sample


def _summary(out: Path) -> dict:
    """`out`'s summary.json, {} when there is none or it is not readable as one."""
    try:
        summary = json.loads(read_bounded(out / "summary.json", MAX_SUMMARY, "summary.json"))
    except (OSError, ValueError, RecursionError):
        return {}
    return summary if isinstance(summary, dict) else {}


def earlier_outputs(out, resume) -> list[str]:
    """The files of another run in `out` that this one would replace: [] when there are none,
    or they are this run's own: the run it resumes from `out`'s checkpoints (`resume`), or an
    earlier attempt of this torchrun job (its summary.json names the job)."""
    out = Path(out)
    found = [name for name in OUTPUTS if os.path.lexists(out / name)]
    here = resume is not None and Path(resume).resolve().parent == (out / "checkpoints").resolve()
    if not found or here or (run_id() is not None and _summary(out).get("run") == run_id()):
        return []
    return found + (["loss.png"] if os.path.lexists(out / "loss.png") else [])


def take_out_dir(out, resume, auto: bool, log=print) -> None:
    """Rank 0, before any work, holding the lock: another run's outputs in `out` are moved
    aside, into earlier_run_<when it last wrote>/, rather than replaced (moved, not refused:
    the chapters' commands share the default --out-dir, and nothing is lost); with --resume
    auto (`auto`), so are the checkpoints it skipped as damaged (newer than `resume`, the
    one it takes), so that this run can save those steps. Each move is said in the log."""
    out = Path(out)
    found = earlier_outputs(out, resume)
    if found:
        newest = max(os.lstat(out / name).st_mtime for name in found)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(newest))  # when that run last wrote
        where, n = out / f"earlier_run_{stamp}", 1
        while where.exists():
            n += 1
            where = out / f"earlier_run_{stamp}_{n}"
        where.mkdir()
        for name in found:
            os.replace(out / name, where / name)
        log(f"--out-dir {out} held another run's {', '.join(found)}: moved them to {where}/, so "
            "that this run's own do not replace them")
    if auto:
        for old, new in set_aside(out / "checkpoints", resume):
            log(f"--resume auto: moved the damaged {old.name} it skipped to {new.name}, so that this "
                f"run can save that step (inspect it: python -m minidist.run.checkpoints {new})")
