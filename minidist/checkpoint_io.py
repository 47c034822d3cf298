"""Checkpoint files: the format on disk, checksums, reading, and finding the damage.
Chapter 08 (chapters/08_at_scale.md); minidist/checkpoint.py decides what each rank saves
and loads, this module how it lies on disk. Exercised by:

    python -m minidist.checkpoint out/checkpoints      # each checkpoint: intact, or damaged and where
    python -m minidist.bench checksums                 # what the checksums cost

A checkpoint folder holds meta.json and one shard_RRRRR_of_NNNNN.pt per rank that saved
it. Format 2 adds checksums: each shard file carries the CRC-32 of every piece's bytes
(and of its scalars and RNG states), and meta.json the CRC-32 of its own content. A
disk that flips bits, a copy cut short, a hand edit of "step": each would load as
garbage and train on; with the checksums it is an error that names the folder, the file
and the tensor. CRC-32 (zlib.crc32, over the tensor's bytes through numpy) because it is
cheap, a few GB/s on one core, about as fast as Adler-32, and better at what a disk does:
it catches every burst of up to 32 flipped bits. It guards against accidents, not an
adversary (who could recompute it); that would need a cryptographic hash, which is slower.
Format 1 (no checksums) still loads, unverified.
"""

from __future__ import annotations

import json
import math
import os
import sys
import zlib
from pathlib import Path

import torch

from minidist.metrics import to_json

FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete or unreadable: the message says where."""


def checksum(value) -> int:
    """CRC-32 of a tensor's bytes (of a plain value's repr otherwise)."""
    if torch.is_tensor(value):
        return zlib.crc32(value.detach().reshape(-1).view(torch.uint8).numpy())
    return zlib.crc32(repr(value).encode())


def shard_checksums(shard: dict) -> dict:
    """What save() stores beside a shard's contents: a checksum for everything in it."""
    return {"pieces": [checksum(t) for *_, t in shard["pieces"]],
            "scalars": {k: checksum(v) for k, v in shard["scalars"].items()},
            "rng": {k: checksum(v) for k, v in shard["rng"].items()}}


def shard_name(rank: int, world: int) -> str:
    return f"shard_{rank:05d}_of_{world:05d}.pt"


# ---- writing -----------------------------------------------------------------------

def fsync(path: Path) -> None:
    """Flush a file, or a folder's entries (its renames), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """write(tmp_path), then rename over `path`: a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.partial")
    write(tmp)
    fsync(tmp)
    os.replace(tmp, path)


def _meta_text(meta: dict) -> str:
    return to_json({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True)


def write_meta(path: Path, meta: dict) -> None:
    """meta.json with the checksum of its own content (strict JSON: NaN becomes null)."""
    meta = json.loads(_meta_text(meta))  # what a reader will see: lists, not tuples
    meta["checksum"] = zlib.crc32(_meta_text(meta).encode())
    atomic_write(path, lambda f: Path(f).write_text(to_json(meta, indent=1)))


# ---- finding and reading ------------------------------------------------------------

def list_checkpoints(root) -> list[Path]:
    """The complete checkpoints under `root`, oldest first (hidden, unfinished ones are
    not listed: a folder named step_* exists only once it is whole)."""
    return sorted(p for p in Path(root).glob("step_*") if (p / "meta.json").is_file())


def latest(root) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_meta(path) -> dict:
    """meta.json, checked against its checksum (format 2)."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete minidist checkpoint (no meta.json)")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'meta.json'}: not readable JSON ({e})") from None
    if meta.get("format", 1) >= 2 and zlib.crc32(_meta_text(meta).encode()) != meta.get("checksum"):
        raise CheckpointError(f"{path / 'meta.json'}: its content does not match its checksum "
                              "(edited or damaged)")
    return meta


class Reader:
    """Every piece of a checkpoint, indexed by key, memory-mapped (read lazily). Opening
    checks meta.json, that every rank's file is there and readable, and the small things
    (scalars, RNG states); verify() checks pieces, reading their bytes."""

    def __init__(self, path):
        self.path, self.meta = Path(path), read_meta(path)
        world = self.meta["world_size"]
        files = sorted(self.path.glob("shard_*.pt"))
        missing = [n for n in map(shard_name, range(world), [world] * world)
                   if not (self.path / n).is_file()]
        if missing or len(files) != world:
            raise CheckpointError(f"{self.path}: incomplete, {len(files)} shard files for a "
                                  f"checkpoint saved by {world} ranks (missing: {', '.join(missing) or '?'})")
        self.pieces, self.shapes, self.scalars, self.rng = {}, {}, {}, {}
        self._sums = {}  # (key, start) -> (crc, file name): what verify() compares
        for f in files:
            try:
                shard = torch.load(f, mmap=True, weights_only=True, map_location="cpu")
            except Exception as e:  # a truncated or overwritten file: name it
                raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from None
            sums = shard.get("checksums")
            if sums is None and self.meta.get("format", 1) >= 2:
                raise CheckpointError(f"{f}: no checksums, in a checkpoint whose format has them")
            for i, (key, shape, start, t) in enumerate(shard["pieces"]):
                self.pieces.setdefault(key, []).append((start, t))
                self.shapes[key] = tuple(shape)
                if sums:
                    self._sums[(key, start)] = (sums["pieces"][i], f.name)
            for what in ("scalars", "rng"):
                for k, v in shard[what].items():
                    if sums and checksum(v) != sums[what][k]:
                        label = {"scalars": "optimizer scalar", "rng": "RNG state"}[what]
                        raise CheckpointError(f"{f}: {label} {k} does not match its checksum")
            self.scalars.update(shard["scalars"])
            self.rng[shard["rank"]] = shard["rng"]

    def problems(self, keys=None) -> list[str]:
        """The pieces (of `keys`, or of all) whose bytes do not match their checksums."""
        out = []
        for key in self.shapes if keys is None else keys:
            for s, t in self.pieces.get(key, []):
                crc, file = self._sums.get((key, s), (None, None))
                if crc is not None and checksum(t) != crc:
                    out.append(f"{self.path / file}: tensor {key}, elements [{s}, {s + t.numel()}) "
                               "do not match their checksum")
        return out

    def verify(self, keys=None) -> None:
        """Raise CheckpointError naming the first damaged piece (of `keys`, or of all)."""
        bad = self.problems(keys)
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise CheckpointError(f"checkpoint {self.path} is damaged: {bad[0]}{more}")

    def read(self, key: str, start: int, n: int) -> torch.Tensor:
        """Elements [start, start + n) of the flattened tensor `key`."""
        out = torch.empty(n, dtype=self.pieces[key][0][1].dtype)
        have = torch.zeros(n, dtype=torch.bool)  # which elements some piece supplied
        for s, t in self.pieces[key]:
            a, b = max(start, s), min(start + n, s + t.numel())
            if a < b:
                out[a - start:b - start] = t[a - s:b - s]
                have[a - start:b - start] = True
        if not bool(have.all()):
            raise ValueError(f"{self.path}: elements [{start}, {start + n}) of {key} are not all "
                             f"in the checkpoint ({int(have.sum())} of {n} found): it is damaged")
        return out

    def consolidated(self) -> dict[str, torch.Tensor]:
        """Every key as one full tensor, whatever the sharding it was saved with (verified)."""
        self.verify()
        out = {k: self.read(k, 0, math.prod(shape)).view(shape) for k, shape in self.shapes.items()}
        return {**out, **self.scalars}


def verify(path) -> list[str]:
    """What is wrong with checkpoint `path`: [] when it is intact. Reads every byte."""
    try:
        return Reader(path).problems()
    except (CheckpointError, FileNotFoundError) as e:
        return [str(e)]


def main(argv=None) -> None:
    """python -m minidist.checkpoint PATH: every checkpoint under PATH (or PATH itself),
    intact or damaged and where; then what the newest intact one holds. Exit code 1 if
    one is damaged."""
    path = Path((argv or sys.argv[1:] or ["."])[0])
    found = [path] if (path / "meta.json").exists() else list_checkpoints(path)
    if not found:
        sys.exit(f"{path}: no minidist checkpoint here (no meta.json, no step_* folder with one)")
    intact = []
    for p in found:
        bad = verify(p)
        if bad:
            print(f"{p}: DAMAGED\n    " + "\n    ".join(bad[:5]) + (f"\n    ... {len(bad) - 5} more" if len(bad) > 5 else ""))
        else:
            r = Reader(p)
            intact.append(r)
            sums = "checksums verified" if r.meta.get("format", 1) >= 2 else "format 1: no checksums"
            print(f"{p}: intact ({sums}), step {r.meta['step']}, saved by {r.meta['world_size']} rank(s)")
    if intact:
        r = intact[-1]
        print(f"{r.path} holds:")
        for key, shape in sorted(r.shapes.items()):
            print(f"  {key:60s} {str(list(shape)):>14s}  in {len(r.pieces[key])} piece(s)")
    if len(intact) < len(found):
        sys.exit(1)
