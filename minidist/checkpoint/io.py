"""Checkpoint files: the format on disk, checksums, the schema, reading, and finding the
damage. Chapter 08 (chapters/08_at_scale.md); minidist/checkpoint/sharded.py decides what each
rank saves and loads, this module how it lies on disk. Exercised by:

    python -m minidist.run.checkpoints out/checkpoints  # each checkpoint: intact, or damaged and where
    python -m minidist.bench checksums                 # what the checksums cost

A folder step_SSSSSSSS holds meta.json and one shard_RRRRR_of_NNNNN.pt per rank. Each
shard carries the CRC-32 of every piece's bytes, meta.json of its own content: cheap, and
it catches every burst of up to 32 flipped bits (an accident, not an adversary). A
checkpoint is read only when whole (minidist/checkpoint/schema.py); rotation (prune)
deletes only folders save() wrote, never the checkpoint just saved.
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import re
import shutil
import zlib
from pathlib import Path

import torch

from minidist.files import NotARegularFile, open_regular, read_bounded
from minidist.checkpoint.schema import (FORMAT, MARKER, MAX_META_BYTES, SHARD_NAME,  # noqa: F401
                                        checkpoint_step, coverage_problem, meta_problem, seal,
                                        shard_name, shard_problem, shorten, written_by_minidist, to_json)


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete or unreadable: the message says where."""


def checksum(value) -> int:
    """CRC-32 of a tensor's bytes (of a plain value's repr otherwise)."""
    if torch.is_tensor(value):
        return zlib.crc32(value.detach().reshape(-1).view(torch.uint8).numpy())
    return zlib.crc32(repr(value).encode())


def shard_checksums(shard: dict) -> dict:
    """What save() stores beside a shard's contents: a checksum for everything in it, and
    (format 3: the shard has an "identity") the seal that ties it to its checkpoint."""
    sums = {"pieces": [checksum(t) for *_, t in shard["pieces"]],
            "scalars": {k: checksum(v) for k, v in shard["scalars"].items()},
            "rng": {k: checksum(v) for k, v in shard["rng"].items()}}
    if "identity" in shard:
        sums["seal"] = seal(shard["identity"], sums)
    return sums


def why_failed(e: OSError, where: Path) -> str:
    """What failed, and what to change: a full disk is not a read-only folder."""
    hint = {errno.ENOSPC: f"free space in {where} or choose another folder",
            errno.EDQUOT: f"free space (disk quota) in {where} or choose another folder",
            errno.EACCES: f"{where} is not writable: fix its permissions or choose another folder",
            errno.EPERM: f"{where} is not writable: fix its permissions or choose another folder",
            errno.EROFS: f"{where} is on a read-only file system: choose another folder"}
    return f"{e}; {hint.get(e.errno, f'check that {where} exists and can be written')}"


# ---- writing -----------------------------------------------------------------------

def fsync(path: Path) -> None:
    """Flush a file, or a folder's entries (its renames), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write) -> None:
    """write(tmp_path), then rename over `path`: a reader sees the old file or the new one
    (never a 0-byte or cut one); a failed write (a full disk) leaves no partial file."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        tmp.unlink(missing_ok=True)  # a killed write's leftover (or a link, or a FIFO): never written through
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _meta_text(meta: dict) -> str:
    return to_json({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True)


def write_meta(path: Path, meta: dict) -> None:
    """meta.json with the checksum of its own content (strict JSON). CheckpointError if it
    would not fit the schema: nothing is written that read_meta would call damaged."""
    meta = json.loads(_meta_text(meta))  # what a reader will see: lists, not tuples
    meta["checksum"] = zlib.crc32(_meta_text(meta).encode())
    text = to_json(meta, indent=1)
    problem = meta_problem(meta) or (len(text) > MAX_META_BYTES and
                                     f"{len(text):,} bytes, more than the {MAX_META_BYTES:,} a reader accepts")
    if problem:
        raise CheckpointError(f"{path}: not written, it would not read back ({problem})")
    atomic_write(path, lambda f: Path(f).write_text(text))


# ---- finding and reading ------------------------------------------------------------

def list_checkpoints(root) -> list[Path]:
    """The complete checkpoints under `root`, oldest first: folders named exactly as save()
    names them (step_00000100, not step_00000100.good) that hold a meta.json."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir()]
    return [p for s, p in sorted((s, p) for s, p in found if s is not None)
            if (p / "meta.json").is_file()]


def latest(root) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


JUNK = re.compile(r"\.(tmp|old)_step_\d{8,}")  # what a save that was killed leaves


def prune(root, keep: int, final: Path | None = None) -> None:
    """Keep the newest `keep` checkpoints under `root` (0: all), and always `final` (the one
    just saved); delete the older ones, but only folders save() wrote."""
    if keep <= 0:
        return
    ours = [p for p in list_checkpoints(root) if written_by_minidist(p)]
    for stale in ours[:-keep]:
        if stale != final:
            shutil.rmtree(stale, ignore_errors=True)


def _no_constants(name):
    raise ValueError(f"{name} is not strict JSON")


def read_meta(path) -> dict:
    """meta.json, checked against the schema and its checksum (format 2 on). Raises
    FileNotFoundError when there is none, CheckpointError when it is not a checkpoint's."""
    path = Path(path)
    f = path / "meta.json"
    if not f.exists():
        raise FileNotFoundError(f"{path} is not a complete minidist checkpoint (no meta.json)")
    try:  # a FIFO refused by kind (never opened to block), more than the schema accepts unread
        meta = json.loads(read_bounded(f, MAX_META_BYTES, "meta.json").decode(), parse_constant=_no_constants)
    except NotARegularFile as e:
        raise CheckpointError(str(e)) from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{f}: not readable JSON ({shorten(str(e))})") from None
    except OSError as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None
    problem = meta_problem(meta)
    if problem:
        raise CheckpointError(f"{f}: {problem}")
    if meta["format"] >= 2 and zlib.crc32(_meta_text(meta).encode()) != meta["checksum"]:
        raise CheckpointError(f"{f}: its content does not match its checksum (edited or damaged)")
    step = checkpoint_step(path)
    if step is not None and step != meta["step"]:
        raise CheckpointError(f"{f}: holds step {meta['step']}, in a folder named for step {step}")
    return meta


def _load_shard(f: Path) -> dict:
    """A shard, memory-mapped, that cannot block: torch's mmap takes a path, not a file
    object (torch 2.13), so the file is opened and refused unless regular, and torch given
    the path of that open file (/proc/self/fd/N: the very file checked). Without /proc, the
    name: a FIFO swapped in after the check would block (only a hostile writer wins that)."""
    with open_regular(f, "checkpoint shard") as opened:
        pinned = f"/proc/self/fd/{opened.fileno()}"
        where = pinned if os.path.exists(pinned) else f
        return torch.load(where, mmap=True, weights_only=True, map_location="cpu")  # (the map outlives the fd)


class Reader:
    """Every piece of a checkpoint, indexed by key, memory-mapped (read lazily). Opening
    checks meta.json, every rank's file, coverage and the scalars and RNG states;
    verify() checks the pieces' bytes."""

    def __init__(self, path):
        self.path, self.meta = Path(path), read_meta(path)
        world = self.meta["world_size"]
        try:  # the files there bound what meta.json may claim, before anything is built
            names = {p.name for p in self.path.iterdir() if SHARD_NAME.fullmatch(p.name)}
        except OSError as e:
            raise CheckpointError(f"{self.path}: unreadable ({e})") from None
        missing = list(itertools.islice(
            (n for n in (shard_name(r, world) for r in range(world)) if n not in names), 5))
        if missing or len(names) != world:
            extra = sorted(names - {shard_name(r, world) for r in range(world)}) if not missing else []
            raise CheckpointError(
                f"{self.path}: incomplete, {len(names)} shard files for a checkpoint saved by "
                f"{world} ranks (missing: {', '.join(missing) + (' ...' if len(missing) == 5 else '') or 'none'}"
                + (f"; not its own: {', '.join(extra[:5])}" if extra else "") + ")")
        self.pieces, self.shapes, self.scalars, self.rng = {}, {}, {}, {}
        self._sums = {}  # (key, start) -> (crc, file name): what verify() compares
        for rank in range(world):
            f = self.path / shard_name(rank, world)
            try:
                shard = _load_shard(f)
            except NotARegularFile as e:
                raise CheckpointError(str(e)) from None
            except Exception as e:  # a truncated or overwritten file: name it
                raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {shorten(str(e))})") from None
            problem = shard_problem(shard, rank, self.meta)
            if problem:
                raise CheckpointError(f"{f}: {problem}")
            sums = shard.get("checksums")
            for i, (key, shape, start, t) in enumerate(shard["pieces"]):
                if self.shapes.setdefault(key, tuple(shape)) != tuple(shape):
                    raise CheckpointError(f"{f}: tensor {key} has shape {list(shape)} here and "
                                          f"{list(self.shapes[key])} in another file")
                self.pieces.setdefault(key, []).append((start, t))
                if sums:
                    self._sums[(key, start)] = (sums["pieces"][i], f.name)
            for what in ("scalars", "rng"):
                for k, v in shard[what].items():
                    if sums and checksum(v) != sums[what][k]:
                        label = {"scalars": "optimizer scalar", "rng": "RNG state"}[what]
                        raise CheckpointError(f"{f}: {label} {k} does not match its checksum")
            self.scalars.update(shard["scalars"])
            self.rng[rank] = shard["rng"]
        for key, shape in self.shapes.items():  # every element once: shapes bounded by the files
            problem = coverage_problem(key, shape, self.pieces[key])
            if problem:
                raise CheckpointError(f"{self.path}: {problem}: it is damaged")

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


class CheckpointPastEndError(ValueError):
    """The checkpoint's step is past the end of the run that would resume from it."""


def check_step(meta_or_path, steps: int) -> None:
    """Raise CheckpointPastEndError if the checkpoint (its meta, or its folder) was saved
    at a step beyond `steps`, the resuming run's planned end: it would train nothing."""
    named = isinstance(meta_or_path, (str, os.PathLike))
    meta = read_meta(meta_or_path) if named else meta_or_path
    if meta["step"] > steps:
        where = f"checkpoint {meta_or_path}" if named else "the checkpoint"
        raise CheckpointPastEndError(f"{where} at step {meta['step']} is past --steps {steps}: "
                                     "raise --steps or start fresh")


def verify(path) -> list[str]:
    """What is wrong with checkpoint `path`: [] when it is intact. Reads every byte."""
    try:
        return Reader(path).problems()
    except (CheckpointError, OSError) as e:  # (no meta.json: a FileNotFoundError)
        return [str(e)]
