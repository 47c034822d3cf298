"""What a run of train_gpt leaves and how it ends: metrics.jsonl, written as it goes, in
strict JSON (a NaN is written as null); the loss plot; the watch that stops a run whose loss
stays non-finite; and Ending: summary.json and one line saying how to resume. Chapter 08
(chapters/08_at_scale.md) uses these endings. Exercised by tests/test_reliability.py.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import tempfile
from pathlib import Path

from minidist.checkpoint.schema import finite_or_none, to_json  # noqa: F401 (strict JSON, as meta.json)


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
    fig.savefig(path, dpi=120, bbox_inches="tight")


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
        if os.path.isdir(f):
            return f"{f} is a folder, but the run writes a file there: move it away, or choose another --out-dir"
        try:
            if os.path.exists(f):
                open(f, "a").close()  # opened for writing, nothing written
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
    """The log rows of a run, a list that also appends each row to `path` (metrics.jsonl),
    flushed, so a kill keeps every row so far. It starts with `rows` (a resumed run's), so
    it reads as one run. `write=False` (ranks other than 0): a plain list."""

    def __init__(self, path, rows=(), write: bool = True):
        super().__init__()
        self.file = open(path, "w") if write else None
        for row in rows:
            self.append(row)

    def append(self, row) -> None:
        super().append(row)
        if self.file:
            self.file.write(to_json(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


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

    def end(self, how: str, line: str, step: int, facts: dict) -> None:
        self.rows.close()
        if not self.is_main:
            return
        summary = {"ended": how, "why": line, "stopped_at_step": step, "steps": self.args.steps,
                   "checkpoint": self.good and str(self.good), "resume": self.resume_command(),
                   **facts, "world_size": self.world, "args": vars(self.args)}
        try:
            (self.out / "summary.json").write_text(to_json(summary, indent=1))
            if any("loss" in r for r in self.rows):
                plot_losses(self.rows, self.out / "loss.png")
        except Exception as e:  # the line below matters more than these files
            line += f" (and summary.json or loss.png could not be written: {e})"
        self.say(line)

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
