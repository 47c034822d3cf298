"""`python -m minidist.run.checkpoints PATH`: every checkpoint under PATH, intact or damaged
and where, then what the newest intact one holds. Chapter 08 (chapters/08_at_scale.md);
minidist/checkpoint/io.py reads and verifies the files."""

from __future__ import annotations

import sys
from pathlib import Path

from minidist.checkpoint.io import CheckpointError, Reader, list_checkpoints


def main(argv=None) -> None:
    """python -m minidist.run.checkpoints PATH: every checkpoint under PATH (or PATH itself),
    intact or damaged and where; then what the newest intact one holds. Exit code 1 if
    one is damaged."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m minidist.run.checkpoints",
                                description="Verify minidist checkpoints: every one under PATH, or PATH itself.")
    p.add_argument("path", nargs="?", default=".", help="a checkpoint, or a folder of step_* checkpoints")
    path = Path(p.parse_args(sys.argv[1:] if argv is None else argv).path)
    found = [path] if (path / "meta.json").exists() else list_checkpoints(path)
    if not found and (path / "checkpoints").is_dir():
        found = list_checkpoints(path / "checkpoints")  # a run's --out-dir
    if not found:
        sys.exit(f"{path}: no minidist checkpoint here (no meta.json, no step_* folder with one): "
                 "name a run's OUT_DIR, its OUT_DIR/checkpoints, or one OUT_DIR/checkpoints/step_NNNNNNNN")
    intact = []
    for p in found:
        try:
            r = Reader(p)
            bad = r.problems()
        except (CheckpointError, OSError) as e:
            bad = [str(e)]
        if bad:
            print(f"{p}: DAMAGED\n    " + "\n    ".join(bad[:5]) + (f"\n    ... {len(bad) - 5} more" if len(bad) > 5 else ""))
            continue
        intact.append(r)
        sums = {1: "format 1: no checksums", 2: "checksums verified"}.get(
            r.meta["format"], "checksums and identity verified")
        print(f"{p}: intact ({sums}), step {r.meta['step']}, saved by {r.meta['world_size']} rank(s)")
    if intact:
        r = intact[-1]
        print(f"{r.path} holds:")
        for key, shape in sorted(r.shapes.items()):
            print(f"  {key:60s} {str(list(shape)):>14s}  in {len(r.pieces[key])} piece(s)")
    if len(intact) < len(found):
        sys.exit(1)


if __name__ == "__main__":
    main()
