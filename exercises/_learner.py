"""Where the learner's code runs: never in the process that decides and prints the score.

The grading process (exercises/grade.py) does not import the learner's file. It reads the
file's syntax tree (exercises/_filecheck.py) and grades with `LearnerRef`s: references to
the file's functions and classes that travel by name and are loaded only where they are
used, so the learner's code (its module's top level included) runs

- on the ranks of minidist.run.pool's processes, for the multi-process parts (a LearnerRef
  pickles to "load this name from this file", loaded on the rank; exercises/_harness.py's
  watchdog and deadline stop a rank that hangs there), or
- in a child forked for one check (`run_apart`), for a check that calls the learner's code
  in its own process: a LearnerRef used in the grading process raises `InProcess`, and the
  check runs again in a child with the real objects, under a time limit that names the
  check. The child's stdout and stderr are captured, its verdict comes back as JSON (only a
  pass/fail and a message), and an exit, a signal or a time-out there fails the check,
  saying which.

The report and the exit status come from the grading process alone, after the child is gone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import select
import signal
import sys
import tempfile
import time
from types import SimpleNamespace


class InProcess(BaseException):
    """A LearnerRef was used in the grading process: the check must run apart.
    (A BaseException, so that no check's `except Exception` swallows it.)"""


_LOADED: dict = {}  # module name -> (digest, module): one load per content, per process


def load(path: str, module: str, digest: str | None = None):
    """The learner's module from `path`, loaded under `module` (once per content)."""
    if module in _LOADED and _LOADED[module][0] == digest and digest is not None:
        return _LOADED[module][1]
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        sys.modules.pop(module, None)
        raise ImportError(f"exercises/{os.path.basename(path)} does not load: "
                          f"{type(e).__name__}: {e}") from e
    _LOADED[module] = (digest, mod)
    return mod


def _attr(path: str, module: str, name: str, digest: str):
    """What a LearnerRef unpickles to, where the learner's code runs."""
    mod = load(path, module, digest)
    try:
        return getattr(mod, name)
    except AttributeError:
        raise ImportError(f"exercises/{os.path.basename(path)} has no {name}") from None


class LearnerRef:
    """One name of the learner's file, by reference (see the module docstring). Equal
    references (same file content, same name) are equal, so results cached per
    implementation are shared by gradings of the same file."""

    __slots__ = ("path", "module", "name", "digest")

    def __init__(self, path: str, module: str, name: str, digest: str):
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "digest", digest)

    @classmethod
    def of(cls, path, module: str, name: str) -> "LearnerRef":
        with open(path, "rb") as f:
            digest = hashlib.sha1(f.read()).hexdigest()
        return cls(str(path), module, name, digest)

    def _key(self):
        return (self.path, self.module, self.name, self.digest)

    def __reduce__(self):
        return _attr, self._key()

    def __eq__(self, other):
        return isinstance(other, LearnerRef) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return f"<{self.name} of {os.path.basename(self.path)}>"

    def resolve(self):
        return _attr(*self._key())

    def __call__(self, *args, **kwargs):
        raise InProcess(self.name)

    def __getattr__(self, attr):
        raise InProcess(self.name)

    def __setattr__(self, attr, value):
        raise InProcess(self.name)

    def __mro_entries__(self, bases):
        raise InProcess(self.name)


def resolved(impl: SimpleNamespace) -> SimpleNamespace:
    """The real objects; `learner_names` says which came from the learner's file (what a
    check may hold to rules the grader's and minidist's own code are not held to)."""
    real = SimpleNamespace(**{k: v.resolve() if isinstance(v, LearnerRef) else v
                              for k, v in vars(impl).items()})
    real.learner_names = frozenset(k for k, v in vars(impl).items() if isinstance(v, LearnerRef))
    return real


_INHERITED: list = []


def _child_fresh_processes() -> None:
    """In the forked child: processes the grading process holds (its pools, its fork
    server) are not the child's to drive; the child starts its own if it needs them."""
    try:
        import minidist.run.pool as pool
        # kept referenced: freeing them here would stop a rendezvous server thread that
        # is not in the fork (a crash); os._exit ends the child without freeing anything
        _INHERITED.append(dict(pool._SHARED))
        pool._SHARED.clear()
    except Exception:
        pass
    try:
        import multiprocessing.forkserver as fs
        fresh = fs.ForkServer()
        fs._forkserver = fresh
        for name in ("ensure_running", "get_inherited_fds", "connect_to_new_process",
                     "set_forkserver_preload"):
            setattr(fs, name, getattr(fresh, name))
    except Exception:
        pass


def _close_child_pools() -> None:
    try:
        import minidist.run.pool as pool
        for p in pool._SHARED.values():
            p.close(wait_s=2)
    except Exception:
        pass


def run_apart(run, check_name: str, impl: SimpleNamespace, limit_s: float) -> tuple[bool, str, str]:
    """(passed, message, what the learner's code printed): `run(real impl)` -> (ok, msg)
    in a forked child, stopped after `limit_s` seconds."""
    out = tempfile.TemporaryFile()
    rfd, wfd = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:  # the child: nothing it does reaches the grading process but one JSON line
        try:
            os.close(rfd)
            os.setpgid(0, 0)  # its own process group: stopped with whatever it started
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            import faulthandler
            faulthandler.disable()  # a crash here is reported by the grading process, once
            # the grading process's OpenMP threads are not in the fork: a parallel region
            # would wait on them forever; one thread here (the child is one check's worth)
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(1)
            _child_fresh_processes()
            try:
                ok, msg = run(resolved(impl))
                verdict = {"ok": bool(ok), "message": str(msg)}
            except SystemExit as e:
                verdict = {"ok": False, "message": f"your code called sys.exit({e.code!r}) during "
                           f"'{check_name}': the check fails (exiting is not an answer)"}
            except BaseException as e:  # noqa: B036 - anything the learner's code raised
                verdict = {"ok": False, "message": f"{type(e).__name__}: {e}"}
            _close_child_pools()
            os.write(wfd, (json.dumps(verdict) + "\n").encode())
        finally:
            os._exit(0)
    os.close(wfd)
    data, t_end, stopped = b"", time.monotonic() + limit_s, False
    try:
        while True:
            left = t_end - time.monotonic()
            if left <= 0:
                stopped = True
                break
            ready, _, _ = select.select([rfd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(rfd, 1 << 16)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(rfd)
        if stopped:
            for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    target()
                except OSError:
                    pass
        _, status = os.waitpid(pid, 0)
        if not stopped:  # whatever it left running in its group goes with it
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    out.seek(0)
    printed = out.read().decode(errors="replace")
    out.close()
    if stopped:
        return False, (f"'{check_name}' was still running after {limit_s:.0f}s and was "
                       "stopped (an endless loop, or far too slow)"), printed
    line = data.split(b"\n", 1)[0]
    try:
        verdict = json.loads(line)
        ok, msg = verdict["ok"], verdict["message"]
        if not isinstance(ok, bool) or not isinstance(msg, str):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        if os.WIFSIGNALED(status):
            why = f"was killed by signal {os.WTERMSIG(status)}"
            if os.WTERMSIG(status) == signal.SIGSEGV:
                why += " (a crash)"
        else:
            why = f"exited with status {os.WEXITSTATUS(status)} (os._exit or a hard crash)"
        return False, (f"the process running your code for '{check_name}' {why} before the "
                       "check finished: the check fails"), printed
    return ok, msg, printed


def preflight(probe, *fns, limit_s: float = 30.0):
    """probe(*fns) -> a stub's hint (str) or None, run where the learner's code may run:
    here for the grader's and minidist's functions, in a forked child for LearnerRefs
    (None, "let the ranks show it", when the child fails)."""
    if not any(isinstance(f, LearnerRef) for f in fns):
        return probe(*fns)
    ns = SimpleNamespace(**{f"f{i}": f for i, f in enumerate(fns)})

    def run(real):
        hint = probe(*(getattr(real, f"f{i}") for i in range(len(fns))))
        return True, json.dumps(hint if isinstance(hint, str) else None)
    ok, msg, _ = run_apart(run, "a first call of your code", ns, limit_s)
    try:
        hint = json.loads(msg) if ok else None
    except ValueError:
        return None
    return hint if isinstance(hint, str) else None
