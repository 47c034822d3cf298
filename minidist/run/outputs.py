"""What a run of train_gpt leaves and how it ends: metrics.jsonl, written as it goes, in
strict JSON (a NaN is written as null); the loss plot; the watch that stops a run whose loss
stays non-finite; and Ending: summary.json and one line saying how to resume. Chapter 08
(chapters/08_at_scale.md) uses these endings. Exercised by tests/test_reliability.py and
tests/test_outputs.py.

Every file here tells the truth at every moment, a kill or a full disk included:
summary.json says "running" from the run's first write to its end (mark_running), and it
and loss.png are replaced whole (atomic_write), never left cut or 0 bytes; metrics.jsonl
holds whole rows only (MetricsFile).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shlex
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

from minidist import checkpoint
from minidist.checkpoint.io import atomic_write
from minidist.checkpoint.schema import finite_or_none, to_json  # noqa: F401 (strict JSON, as meta.json)
from minidist.files import kind_of
from minidist.run.locks import run_id


def plot_losses(rows, path) -> None:
    """Train and validation loss against step, saved to `path` (a Figure of its own: no
    pyplot, so a notebook's backend is left as it was)."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    ax.plot(*zip(*tr), label="train")
    if va:
        ax.plot(*zip(*va), "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="minidist train_gpt")
    ax.legend(), ax.grid(alpha=0.3)
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))


def write_json(path, obj) -> None:
    """`obj` as strict JSON in `path`, atomically: the old file or the whole new one."""
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(to_json(obj, indent=1)))


def mark_running(out, settings: dict) -> None:
    """summary.json, replaced as a run starts writing in `out` by one that says it is in
    progress: a run killed before its end (rank 0 lost) never leaves an earlier run's
    "completed" beside its own metrics. Marked rather than removed: the folder says which
    run is there (or was, killed, if this stays), and a restart of the same torchrun job
    knows its own. If not even this fits on the disk, the old one is removed."""
    path = Path(out) / "summary.json"
    note = {"ended": "running", "why": "in progress, or killed: a run that ends says how here",
            "run": run_id(), "host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": settings.get("steps"),
            "resumed_from": settings.get("resume"), "args": settings}
    try:
        write_json(path, note)
    except OSError:
        path.unlink(missing_ok=True)


# ---- what a run writes, as it goes ------------------------------------------------

OUTPUT_FILES = ("metrics.jsonl", "summary.json", "loss.png", "run.lock")


def output_problem(out, checkpoints: bool = False) -> str | None:
    """What stops a run from writing in folder `out` (--out-dir, made if missing), or its
    checkpoints/ (with `checkpoints`), or None: tried before the first step, not found at
    the first save or after the last step."""
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--out-dir {out} is a file, not a folder: name a folder"
    try:
        os.makedirs(out, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()  # a write, really tried
    except OSError as e:
        return f"--out-dir {out} cannot be written ({e.strerror or e}): choose another folder"
    for f in (os.path.join(out, name) for name in OUTPUT_FILES):
        try:
            mode = os.stat(f).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"{f} cannot be read ({e.strerror or e}): fix it, or choose another --out-dir"
        if not stat.S_ISREG(mode):  # a FIFO opened to write would block: refused by kind
            return f"{f} is {kind_of(mode)}, but the run writes a file there: move it away, or choose another --out-dir"
        try:
            os.close(os.open(f, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))  # opened to write, nothing written
        except OSError as e:
            return f"{f} cannot be written ({e.strerror or e}): fix its permissions, or choose another --out-dir"
    root = os.path.join(out, "checkpoints")
    if checkpoints and os.path.exists(root):
        if not os.path.isdir(root):
            return (f"{root} is a file, but --checkpoint-every writes checkpoints in a folder there: "
                    "move it away, or choose another --out-dir")
        try:
            tempfile.TemporaryFile(dir=root).close()
        except OSError as e:
            return f"{root} cannot be written ({e.strerror or e}): fix its permissions, or choose another --out-dir"
    return None


class MetricsFile(list):
    """The log rows of a run, a list that also appends each row to `path` (metrics.jsonl) as
    it comes, so a kill keeps every row so far. It starts with `rows` (a resumed run's),
    written whole and atomically, so it reads as one run. Each row is then one write() at
    the file's end; one that fails (a full disk) is cut back off, so the file never holds a
    cut row, and the rows not written go with the next write that works (the list keeps
    them all; `error` says why while some are missing). `write=False` (ranks other than
    0): a plain list."""

    def __init__(self, path, rows=(), write: bool = True):
        super().__init__(rows)
        self.path, self.fd, self.written, self.error = Path(path), None, len(self), None
        if write:
            atomic_write(self.path, lambda tmp: Path(tmp).write_text("".join(to_json(r) + "\n" for r in self)))
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def append(self, row) -> None:
        super().append(row)
        self._write()

    def _write(self) -> None:
        if self.fd is None or self.written == len(self):
            return
        data = "".join(to_json(r) + "\n" for r in self[self.written:]).encode()
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            if os.write(self.fd, data) != len(data):  # the disk filled up within this write
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            self.written, self.error = len(self), None
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)  # no cut row left for a reader to take as whole
            if self.error is None:
                print(f"warning: {self.path}: the row of step {self[self.written].get('step')} not written "
                      f"({e}); kept, and written with the next row that fits", file=sys.stderr, flush=True)
            self.error = e

    def close(self) -> None:
        if self.fd is not None:
            self._write()
            os.close(self.fd)
            self.fd = None


NONFINITE_STEPS = 3  # consecutive non-finite losses that stop a run


class RunStopped(RuntimeError):
    """A run that ended before its last step, or badly: its one line (why, the newest intact
    checkpoint, the command to resume) is printed and summary.json written. `exit_code`:
    what the program exits with; the script prints no traceback for it."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class NonFiniteLoss(RunStopped):
    """The loss stayed NaN or infinite: training on would only write garbage."""


class LossWatch:
    """Stops a run (NonFiniteLoss) once the loss has been non-finite for NONFINITE_STEPS
    steps in a row. Every rank sees the same, all-reduced loss, so all stop at the same
    step. fp16's skipped steps do not count (their loss is finite)."""

    def __init__(self, args):
        self.args, self.since = args, None  # the first step of the current bad streak

    def check(self, step: int, loss: float) -> None:
        if math.isfinite(loss):
            self.since = None
            return
        self.since = self.since or step
        if step - self.since + 1 >= NONFINITE_STEPS:
            a = self.args
            raise NonFiniteLoss(
                f"step {step}: the loss has been {loss} for {NONFINITE_STEPS} steps in a row "
                f"(steps {self.since}-{step}); stopping rather than training on garbage. Check "
                f"the learning rate (--lr {a.lr:g}, --warmup-steps {a.warmup_steps}), the "
                f"precision (--precision {a.precision}: fp16 can overflow, try bf16 or fp32) "
                f"and the data (token ids within the vocabulary of --tokenizer {a.tokenizer})")


class Ending:
    """summary.json, loss.png and, on rank 0, one line naming why, the newest good checkpoint
    (`good`) and the command that resumes. Collective-free: works after a rank is lost."""

    def __init__(self, args, argv, world_size: int, is_main: bool, rows, good=None):
        self.args, self.argv, self.world, self.is_main, self.rows = args, argv, world_size, is_main, rows
        self.out, self.good = Path(args.out_dir), good

    def say(self, line: str) -> None:
        if self.is_main:
            print(line, file=sys.stderr, flush=True)

    def resume_command(self) -> str:
        words, skip = [], False
        for w in self.argv:  # the run's own command line, less its --resume
            if skip or w == "--resume" or w.startswith("--resume="):
                skip = w == "--resume" and not skip
                continue
            words.append(w)
        if self.good is not None:
            here = Path(self.good).resolve().parent == (self.out / "checkpoints").resolve()
            words += ["--resume", "auto" if here else str(self.good)]
        launcher = ["torchrun", f"--nproc_per_node={self.world}"] if self.world > 1 else ["python"]
        return shlex.join([*launcher, "minidist/train_gpt.py", *words])

    def where_to_resume(self) -> str:
        if self.good is None:
            return f"no checkpoint to resume from (--checkpoint-every N saves them); start again: {self.resume_command()}"
        return f"newest intact checkpoint {self.good}; resume: {self.resume_command()}"

    def write(self, summary: dict) -> str:
        """summary.json (with this run's id) and loss.png, each whole or not at all (rank 0);
        returns what could not be written, a note for the run's last line ("" if nothing)."""
        self.rows.close()
        notes = [f"metrics.jsonl lacks its last {len(self.rows) - self.rows.written} rows: "
                 f"{self.rows.error}"] if self.rows.error else []
        try:
            write_json(self.out / "summary.json", {**summary, "run": run_id()})
            if any("loss" in r for r in self.rows):
                plot_losses(self.rows, self.out / "loss.png")
        except Exception as e:  # the run's last line matters more than these files
            notes.append(f"summary.json or loss.png could not be written: {e}")
        return "".join(f" (and {n})" for n in notes)

    def end(self, how: str, line: str, step: int, facts: dict) -> None:
        self.rows.close()
        if not self.is_main:
            return
        summary = {"ended": how, "why": line, "stopped_at_step": step, "steps": self.args.steps,
                   "checkpoint": self.good and str(self.good), "resume": self.resume_command(),
                   **facts, "world_size": self.world, "args": vars(self.args)}
        self.say(line + self.write(summary))

    def stop(self, how: str, why: str, step: int, facts: dict, exit_code: int = 1, since=None):
        """End the run early or badly: everything written, the line said, RunStopped raised
        (NonFiniteLoss for a diverged run)."""
        if how == "diverged":
            a = self.args
            facts = {**facts, "diverged_at_step": since}
            why += (f". No checkpoint was written from non-finite state; {self.where_to_resume()}. "
                    f"What to change: a lower --lr (now {a.lr:g}) or more --warmup-steps, in another "
                    f"--out-dir (a resume keeps them); with --precision fp16, bf16 instead or a "
                    f"smaller --loss-scale-init (now {a.loss_scale_init:g}; a resume may change these)")
        else:
            why += f"; {self.where_to_resume()}"
        self.end(how, why, step, facts)
        raise NonFiniteLoss(why) if how == "diverged" else RunStopped(why, exit_code)

    def failed(self, e: Exception, step: int, facts: dict, collective: bool) -> None:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        who = ("a collective failed, most likely because another rank died or stalled (its own "
               "error says why)" if collective else type(e).__name__)
        self.end("failed", f"stopped in step {step}: {who}: {first}; {self.where_to_resume()}", step,
                 {**facts, "error": f"{type(e).__name__}: {first}"})

    def save(self, step, loss, model, opts, scaler, cfg, args, facts) -> None:
        """A checkpoint, unless the loss or anything it would hold is not finite: such a
        checkpoint would become the newest, and pruning would delete the good ones. A save
        that fails (a full disk) stops the run with its one line: what failed, where to resume."""
        if math.isfinite(loss):
            try:  # (checkpoint.save itself refuses non-finite weights, optimizer state, loss scale)
                self.good = checkpoint.save(Path(args.out_dir) / "checkpoints", step, model, opts, scaler,
                                            keep=args.keep_checkpoints, extra={"settings": vars(args),
                                                                               "rows": self.rows, "config": cfg.to_dict()})
                return
            except checkpoint.NonFiniteCheckpointError:
                pass
            except checkpoint.SaveError as e:
                self.stop("failed", f"stopped at step {step}: {e}", step, {**facts(), "error": str(e)})
        self.say(f"step {step}: no checkpoint saved: the {'model or optimizer state is' if math.isfinite(loss) else 'loss is'} "
                 f"not finite; the newest good one stays {self.good or 'none'}")
