"""Where a run resumes from: the checkpoint `--resume` names (or the newest intact one,
for `--resume auto`), checked before any work: intact, saved by a run with the same
settings, not past the run's end, and not mixed into another run's folder. Chapter 08
(chapters/08_at_scale.md). Exercised by:

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 minidist/train_gpt.py \
        --checkpoint-every 50 --resume auto
    pytest tests/test_reliability.py tests/test_checkpoint_trust.py

A restarted job runs the same command again: `--resume auto` must skip (with one line)
a checkpoint a kill left damaged, and start fresh when there is none yet.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from minidist.checkpoint import io as checkpoint
from minidist.model import PRESETS


def _resolved(settings: dict) -> dict:
    """Model sizes as the run builds them (a checkpoint of an older run may hold None)."""
    preset = PRESETS.get(settings.get("preset"), {})
    return {k: preset.get(k) if v is None and k in ("n_layer", "n_head", "n_embd") else v
            for k, v in settings.items()}


def _same_settings(path: Path, settings: dict, may_change) -> None:
    meta = checkpoint.read_meta(path)
    extra = meta.get("extra", {}) if isinstance(meta, dict) else None
    saved = extra.get("settings", {}) if isinstance(extra, dict) else None
    if not isinstance(saved, dict):  # JSON, but not a checkpoint's: damaged, like a bad file
        raise checkpoint.CheckpointError(f"{Path(path) / 'meta.json'}: not a minidist checkpoint's "
                                         "metadata (no settings where they belong)")
    saved = _resolved(saved)
    changed = [f"{k}: {saved[k]!r} saved, {v!r} now" for k, v in _resolved(settings).items()
               if k in saved and k not in may_change and saved[k] != v]
    if changed:
        raise ValueError(f"{path} was saved by a run with other settings ({'; '.join(changed)}): "
                         "resume with the same ones, or start over in another folder")


def find_resume(resume: str | None, root, settings: dict, may_change=()) -> Path | None:
    """The checkpoint a run should resume from: resume="auto", the newest intact one under
    `root` (None if there is none yet; a damaged one is skipped with one line); a path,
    that checkpoint, which must be intact; None, nothing. ValueError if it was saved with
    other `settings` than these (keys in `may_change` may differ)."""
    if resume is None:
        return None
    if resume != "auto":
        _same_settings(Path(resume), settings, may_change)
        bad = checkpoint.verify(resume)
        if bad:
            raise ValueError(f"{bad[0]}: this checkpoint is damaged; resume from an earlier one "
                             "(--resume auto picks the newest intact one)")
        return Path(resume)
    found = checkpoint.list_checkpoints(root)
    for path in reversed(found):
        try:
            _same_settings(path, settings, may_change)
            bad = checkpoint.verify(path)
        except (checkpoint.CheckpointError, OSError) as e:  # (other settings: a ValueError, raised)
            bad = [str(e)]
        except (KeyError, TypeError, AttributeError, IndexError) as e:  # a meta.json of another shape
            bad = [f"{path / 'meta.json'}: not a minidist checkpoint's ({type(e).__name__}: {e})"]
        if not bad:
            return path
        if os.environ.get("RANK", "0") == "0":  # one line, not one per rank
            print(f"--resume auto: skipping {path.name}, damaged ({bad[0]})", file=sys.stderr)
    if found:
        raise ValueError(f"every checkpoint in {root} is damaged ({len(found)}): delete them, or "
                         "use another --out-dir, to start over")
    return None


def resume_from(resume: str | None, root, checkpoint_every: int, settings: dict, may_change=()):
    """train_gpt's --resume, checked before any work: the checkpoint to resume from (None: a
    fresh start), or ValueError saying what to change. A fresh run is refused where `root`
    holds another run's checkpoints, which its own would be mixed with and pruned."""
    if resume not in (None, "auto") and Path(resume).is_dir() and not (Path(resume) / "meta.json").exists():
        inside = checkpoint.latest(Path(resume)) or checkpoint.latest(Path(resume) / "checkpoints")
        if inside is not None:  # a run's OUT_DIR or its checkpoints folder, not one checkpoint
            raise ValueError(f"{resume} holds checkpoints but is not one: name one, e.g. --resume {inside}, "
                             "or use --resume auto with that run's --out-dir")
    if resume not in (None, "auto") and not Path(resume).is_dir():
        why = "a file, not a checkpoint folder" if Path(resume).exists() else "no such folder"
        raise ValueError(f"{resume} is not a complete minidist checkpoint ({why}): name a checkpoint "
                         "folder (OUT_DIR/checkpoints/step_NNNNNNNN), or use --resume auto")
    if checkpoint_every and checkpoint.latest(root):
        if resume is None:
            raise ValueError(f"{root} holds checkpoints of an earlier run: --resume auto continues it; "
                             "another --out-dir (or deleting them) starts over")
        if resume != "auto" and Path(resume).resolve().parent != Path(root).resolve():
            raise ValueError(f"{root} holds checkpoints of another run, which a run resumed from {resume} "
                             "would mix its own with and prune: give the resumed run another --out-dir, "
                             "or use --resume auto to continue the run that is there")
    try:
        found = find_resume(resume, root, settings, may_change)
        if found and settings.get("steps") is not None:  # a step past the end trains nothing
            checkpoint.check_step(found, settings["steps"])
    except OSError as e:
        raise ValueError(str(e)) from None
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a meta.json of another shape
        raise ValueError(f"{resume}: not a readable minidist checkpoint ({type(e).__name__}: {e}); "
                         "name another checkpoint folder, or use --resume auto") from None
    return found and str(found)


def set_aside(root, kept) -> list[tuple[Path, Path]]:
    """After --resume auto took checkpoint `kept` (None: none, a fresh start), move every
    checkpoint folder under `root` for a later step, the ones it skipped as damaged, out of
    the run's way: step_00000004 -> step_00000004.damaged (.damaged_2, ... if taken), a name
    list_checkpoints and rotation never take. Else the run would die on reaching that step:
    save() does not replace a folder it cannot tell is its own (meta.json emptied, or a
    user's), and one that is its own it would delete, evidence and all. Returns (old, new)
    for each, for the log."""
    after = checkpoint.checkpoint_step(kept) if kept is not None else 0
    root, moved = Path(root), []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        step = checkpoint.checkpoint_step(path)
        if step is None or step <= after:
            continue
        new, n = path.with_name(f"{path.name}.damaged"), 1
        while new.exists():
            n += 1
            new = path.with_name(f"{path.name}.damaged_{n}")
        os.rename(path, new)
        moved.append((path, new))
    return moved
