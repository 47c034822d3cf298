"""Where the learner's code runs: never in the process that decides and prints the score.

The grading process holds `LearnerRef`s, references to the learner file's names that are
loaded where they are used: on the ranks of minidist's shared pools (ranks.py), or in a
child forked for one check (`run_apart`): a LearnerRef used in the grading process raises
`InProcess`, and the check runs again in a child with the real objects, under a time limit,
its output captured (capped) and its verdict sent back as one JSON line. Whatever grading
started goes with it: a signal that stops the grading process kills the child first.
"""

import contextlib
import importlib.util
import json
import os
import select
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

OUTPUT_CAP = 20_000  # characters of the learner's output kept per check


class InProcess(BaseException):
    """A LearnerRef was used in the grading process: the check must run apart.
    (A BaseException, so that no check's `except Exception` swallows it.)"""


_LOADED: dict = {}  # (path, digest) -> module: one load per content, per process


def load(path: str, module: str, digest: str):
    """The learner's module from `path`, loaded under `module` (once per content)."""
    if (path, digest) in _LOADED:
        return _LOADED[path, digest]
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        sys.modules.pop(module, None)
        raise ImportError(f"{os.path.basename(path)} does not load: {type(e).__name__}: {e}") from e
    _LOADED[path, digest] = mod
    return mod


def _attr(path: str, module: str, name: str, digest: str):
    """What a LearnerRef unpickles to, where the learner's code runs."""
    try:
        return getattr(load(path, module, digest), name)
    except AttributeError:
        raise ImportError(f"{os.path.basename(path)} has no {name}") from None


@dataclass(frozen=True)
class LearnerRef:
    """One name of the learner's file, by reference. Equal references (same file content,
    same name) are equal, so results cached per implementation are shared."""
    path: str
    module: str
    name: str
    digest: str

    def _key(self):
        return self.path, self.module, self.name, self.digest

    def __reduce__(self):
        return _attr, self._key()

    def __repr__(self):
        return f"<{self.name} of {os.path.basename(self.path)}>"

    def resolve(self):
        return _attr(*self._key())

    def _apart(self, *args, **kwargs):  # called, read or subclassed here: the check runs apart
        raise InProcess(self.name)
    __call__ = __getattr__ = __mro_entries__ = _apart


def resolved(impl: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(**{k: v.resolve() if isinstance(v, LearnerRef) else v
                              for k, v in vars(impl).items()})


# --------------------------------------------------------------------- the child

_CHILDREN: set = set()  # pids of running children (each leads its own process group)


def _kill_children(*_) -> None:
    for pid in list(_CHILDREN):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


def _close_pools(wait_s: float) -> None:
    try:
        import minidist.run.pool as pool
        for p in list(pool._SHARED.values()):
            p.close(wait_s=wait_s)
    except Exception:  # nothing to close, or already closing
        pass


def _on_signal(signum, frame):
    _kill_children()
    _close_pools(wait_s=1)  # the ranks of the shared pools
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # then end as that signal would have


@contextlib.contextmanager
def taking_children_along():
    """Inside: SIGTERM, SIGHUP or SIGINT end every process grading started, then this one.
    The caller's handlers come back after (only the main thread may set them)."""
    mine = threading.current_thread() is threading.main_thread()
    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)} if mine else {}
    for s, h in kept.items():
        if h in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(s, _on_signal)
    try:
        yield
    finally:
        for s, h in kept.items():
            signal.signal(s, h)


_INHERITED: list = []


def _forget_pools():
    """In the child: the parent's pools and fork server are not the child's to drive; it
    starts its own if it needs them. (Kept referenced: freeing them would stop a server
    thread that is not in the fork; os._exit ends the child without freeing anything.)"""
    kept = None
    try:
        import minidist.run.pool as pool
        kept = dict(pool._SHARED)
        pool._SHARED.clear()
        import multiprocessing.forkserver as fs
        fresh = fs.ForkServer()
        fs._forkserver = fresh
        for name in ("ensure_running", "get_inherited_fds", "connect_to_new_process",
                     "set_forkserver_preload"):
            setattr(fs, name, getattr(fresh, name))
    except Exception:
        pass
    return kept


def _child(run, impl, out_fd: int, wfd: int, check_name: str) -> None:
    os.setpgid(0, 0)  # its own process group: stopped with whatever it starts
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    # the streams Python prints to, on those descriptors (whatever stood in for them here)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)
    import faulthandler
    faulthandler.disable()  # a crash is reported by the grading process, once
    # the parent's OpenMP threads are not in the fork: a parallel region would wait forever
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    _INHERITED.append(_forget_pools())
    try:
        ok, msg = run(resolved(impl))
        verdict = {"ok": bool(ok), "message": str(msg)}
    except SystemExit as e:
        verdict = {"ok": False, "message": f"your code called sys.exit({e.code!r}) during "
                   f"'{check_name}' (exiting is not an answer)"}
    except BaseException as e:  # noqa: B036 - anything the learner's code raised
        verdict = {"ok": False, "message": f"{type(e).__name__}: {e}"}
    _close_pools(wait_s=2)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.write(wfd, (json.dumps(verdict) + "\n").encode())


def run_apart(run, check_name: str, impl: SimpleNamespace, limit_s: float) -> tuple[bool, str, str]:
    """(passed, message, what the learner's code printed): `run(real impl)` -> (ok, msg)
    in a forked child, stopped after `limit_s` seconds."""
    import torch._dynamo  # noqa: F401 - torch.optim imports it on first use: once here, not per child
    out = tempfile.TemporaryFile()
    rfd, wfd = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            _child(run, impl, out.fileno(), wfd, check_name)
        finally:
            os._exit(0)
    _CHILDREN.add(pid)
    os.close(wfd)
    data, t_end, stopped = b"", time.monotonic() + limit_s, False
    try:
        while True:
            left = t_end - time.monotonic()
            if left <= 0:
                stopped = True
                break
            if select.select([rfd], [], [], min(left, 1.0))[0]:
                chunk = os.read(rfd, 1 << 16)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(rfd)
        if stopped:
            _kill_children()
        _, status = os.waitpid(pid, 0)
        try:  # whatever it left running in its group goes with it
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        _CHILDREN.discard(pid)
    size, _ = out.seek(0, os.SEEK_END), out.seek(0)  # what the learner's code printed, capped
    printed = out.read(OUTPUT_CAP).decode(errors="replace") + (
        f"\n... ({size - OUTPUT_CAP} more bytes of output cut)" if size > OUTPUT_CAP else "")
    out.close()
    if stopped:
        return False, (f"'{check_name}' was still running after {limit_s:.0f}s and was "
                       "stopped (an endless loop, or far too slow)"), printed
    try:
        verdict = json.loads(data.split(b"\n", 1)[0])
        ok, msg = verdict["ok"], verdict["message"]
        assert isinstance(ok, bool) and isinstance(msg, str)
    except (ValueError, KeyError, TypeError, AssertionError):
        if os.WIFSIGNALED(status):
            why = f"was killed by signal {os.WTERMSIG(status)}"
        else:
            why = f"exited with status {os.WEXITSTATUS(status)} (os._exit or a hard crash)"
        return False, (f"the process running your code for '{check_name}' {why} before the "
                       "check finished"), printed
    return ok, msg, printed
