"""What a checkpoint's files must be before anything is built from them: the schema of
meta.json, of each shard file, and the identity that binds a shard to its checkpoint.
Chapter 08 (chapters/08_at_scale.md, its appendix says why each rule); io.py reads the
files and asks these questions. Exercised by `pytest tests/test_checkpoint_trust.py`.

Sizes are bounded by the files on disk, so reading never allocates more than they hold.
Identity (format 3): each shard carries (id, step, rank, world size) sealed by a CRC-32,
so a shard copied from another checkpoint is damage. The files decide the format, not
meta.json's claim. Each function returns what is wrong, as a sentence, or None.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from pathlib import Path

import torch

from minidist.files import read_bounded

# ---- strict JSON: meta.json here, and a run's metrics.jsonl and summary.json (minidist.metrics)

def finite_or_none(obj):
    """obj with every NaN or infinity replaced by None, in nested dicts and lists: JSON
    has no NaN, and strict parsers reject Python's "NaN" extension."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def to_json(obj, **kwargs) -> str:
    """Strict JSON: non-finite numbers as null (allow_nan=False proves none is left)."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


FORMAT = 3
MARKER = "minidist checkpoint"  # meta.json's "kind": how rotation knows a folder is minidist's
MAX_META_BYTES = 64 << 20  # a meta.json is KBs (MBs with a long run's log rows); more is not ours
MAX_WORLD = 1 << 20  # ranks: far beyond any run, and the files on disk must match it anyway
MAX_STEP = 10 ** 12
CHECKPOINT_NAME = re.compile(r"step_(\d{8,})")  # what save() names a checkpoint, exactly
SHARD_NAME = re.compile(r"shard_(\d{5,})_of_(\d{5,})\.pt")


def seal(identity: dict, sums: dict) -> int:
    """The CRC-32 that binds a shard to its checkpoint: over its identity and every
    checksum of its contents (so, through them, over its bytes)."""
    table = {k: v for k, v in sums.items() if k != "seal"}
    return zlib.crc32(to_json({"identity": identity, "checksums": table}, sort_keys=True).encode())


def shard_name(rank: int, world: int) -> str:
    return f"shard_{rank:05d}_of_{world:05d}.pt"


def checkpoint_step(path) -> int | None:
    """The step in a folder name that save() could have written (step_00000100: 100);
    None for any other name (step_00000100.good, step_00000100_backup, step_100)."""
    m = CHECKPOINT_NAME.fullmatch(Path(path).name)
    return int(m[1]) if m and Path(path).name == f"step_{int(m[1]):08d}" else None


# ---- the schema of meta.json ----------------------------------------------------------

def shorten(v) -> str:
    """A value for a message, cut short (a hostile file's value can be huge)."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number")


def _int(lo: int, hi: int):
    return (lambda v: type(v) is int and lo <= v <= hi), f"an integer in [{lo}, {hi}]"


def _real(lo: float, hi: float, lo_open=False, hi_open=False):
    def ok(v):
        return (type(v) in (int, float) and math.isfinite(v) and (v > lo if lo_open else v >= lo)
                and (v < hi if hi_open else v <= hi))
    return ok, f"a finite number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


# the loss scaler's state (minidist.scaler.LossScaler.state_dict), or {} when it is off
SCALER_FIELDS = {"scale": _real(0, math.inf, lo_open=True, hi_open=True),
                 "growth_factor": _real(1, math.inf, lo_open=True, hi_open=True),
                 "backoff_factor": _real(0, 1, lo_open=True, hi_open=True),
                 "min_scale": _real(0, math.inf, lo_open=True, hi_open=True),
                 "growth_interval": _int(1, 2**62), "hysteresis": _int(1, 2**62),
                 "growth_tracker": _int(0, 2**62), "overflow_streak": _int(0, 2**62),
                 "skipped_steps": _int(0, 2**62)}
# param-group settings that torch's optimizers do arithmetic with
GROUP_NUMBERS = {"lr": _real(0, math.inf, hi_open=True), "peak_lr": _real(0, math.inf, hi_open=True),
                 "initial_lr": _real(0, math.inf, hi_open=True), "eps": _real(0, math.inf, hi_open=True),
                 "weight_decay": _real(0, math.inf, hi_open=True), "momentum": _real(0, 1),
                 "ns_steps": _int(0, 1000)}
META_KEYS = {"kind", "format", "id", "step", "world_size", "optimizers", "scaler", "extra", "checksum"}
MAX_OPTIMIZERS, MAX_GROUPS = 64, 4096


def _plain(v) -> bool:
    """A JSON scalar, or a flat list of them: what a setting can be."""
    def scalar(x):
        return x is None or type(x) in (str, bool, int) or (type(x) is float and math.isfinite(x))
    return scalar(v) or (type(v) is list and all(scalar(x) for x in v))


def meta_problem(meta) -> str | None:
    """What keeps `meta` (a parsed meta.json) from being a minidist checkpoint's: None when
    its types and ranges fit the schema."""
    if not isinstance(meta, dict):
        return f"not a checkpoint's metadata (a JSON object is expected, this is {_kind(meta)})"
    unknown = sorted(set(meta) - META_KEYS, key=str)
    if unknown:
        return f"not a checkpoint's metadata (unknown field {shorten(unknown[0])})"
    if "format" not in meta:
        return "not a checkpoint's metadata (no 'format')"
    fmt = meta["format"]
    if type(fmt) is not int or fmt < 1:
        return f"'format' must be an integer >= 1, got {shorten(fmt)}"
    if fmt > FORMAT:
        return f"format {fmt} is newer than this minidist reads ({FORMAT}): update minidist"
    need = ["format", "step", "world_size", "optimizers", "scaler", "extra"]
    need += ["checksum"] if fmt >= 2 else []
    need += ["kind", "id"] if fmt >= 3 else []
    missing = [k for k in need if k not in meta]
    if missing:
        return f"not a checkpoint's metadata (no {', '.join(map(repr, missing))})"
    if fmt < 3 and ("kind" in meta or "id" in meta):  # format 3's fields under an older number
        return f"declares format {fmt} but carries format 3's identity: the format was edited"
    checks = {"step": _int(0, MAX_STEP), "world_size": _int(1, MAX_WORLD),
              **({"checksum": _int(0, 2**32 - 1)} if fmt >= 2 else {})}
    for key, (ok, what) in checks.items():
        if not ok(meta[key]):
            return f"{key!r} must be {what}, got {shorten(meta[key])}"
    if fmt >= 3:
        if meta["kind"] != MARKER:
            return f"'kind' must be {MARKER!r}, got {shorten(meta['kind'])}"
        if type(meta["id"]) is not str or not re.fullmatch(r"[0-9a-f]{32}", meta["id"]):
            return f"'id' must be 32 hex digits, got {shorten(meta['id'])}"
    opts = meta["optimizers"]
    if type(opts) is not list or len(opts) > MAX_OPTIMIZERS:
        return f"'optimizers' must be a list of at most {MAX_OPTIMIZERS}, got {_kind(opts)}"
    for i, o in enumerate(opts):
        groups = o.get("param_groups") if type(o) is dict else None
        if type(o) is not dict or set(o) != {"param_groups"} or type(groups) is not list \
                or len(groups) > MAX_GROUPS or not all(type(g) is dict for g in groups):
            return f"optimizers[{i}] must be {{\"param_groups\": [objects]}}, got {shorten(o)}"
        for j, g in enumerate(groups):
            for k, v in g.items():
                ok, what = GROUP_NUMBERS.get(k, (_plain, "a number, string, boolean, null or a list of them"))
                if not ok(v) or not _plain(v):
                    return f"optimizers[{i}].param_groups[{j}].{k} must be {what}, got {shorten(v)}"
    scaler = meta["scaler"]
    if type(scaler) is not dict or (scaler and set(scaler) != set(SCALER_FIELDS)):
        return (f"'scaler' must be {{}} or an object with exactly {', '.join(sorted(SCALER_FIELDS))}, "
                f"got {shorten(scaler)}")
    for k, v in scaler.items():
        ok, what = SCALER_FIELDS[k]
        if not ok(v):
            return f"scaler.{k} must be {what}, got {shorten(v)}"
    return _extra_problem(meta)


def _extra_problem(meta: dict) -> str | None:
    """The caller's `extra` is its own, but train_gpt reads three of its fields back."""
    extra = meta["extra"]
    if type(extra) is not dict:
        return f"'extra' must be an object, got {_kind(extra)}"
    settings, rows, config = extra.get("settings", {}), extra.get("rows", []), extra.get("config", {})
    if type(settings) is not dict or not all(_plain(v) for v in settings.values()):
        return "extra.settings must be an object of numbers, strings, booleans, nulls or lists of them"
    if settings.get("preset") is not None and type(settings["preset"]) is not str:
        return f"extra.settings.preset must be a string or null, got {shorten(settings['preset'])}"
    if type(rows) is not list or not all(type(r) is dict for r in rows):
        return "extra.rows must be a list of objects"
    if type(config) is not dict:
        return f"extra.config must be an object, got {_kind(config)}"
    planned = settings.get("steps")
    if type(planned) is int and meta["step"] > planned:  # a step edited past the run's own end
        return f"step {meta['step']} is past the end of the run that saved it (--steps {planned})"
    return None



def written_by_minidist(path) -> bool:
    """Whether folder `path` is one that save() wrote (named step_SSSSSSSS, its meta.json
    with minidist's marker): rotation may delete it, damaged or not; nothing else."""
    path = Path(path)
    f = path / "meta.json"
    if checkpoint_step(path) is None:
        return False
    try:  # (a FIFO, or more than any meta.json: refused unread, NotARegularFile is a ValueError)
        meta = json.loads(read_bounded(f, MAX_META_BYTES, "meta.json").decode())
    except (ValueError, RecursionError, OSError):
        return False
    if not isinstance(meta, dict):
        return False
    if meta.get("kind") == MARKER:
        return True
    return meta.get("format") in (1, 2) and {"step", "world_size", "optimizers", "scaler"} <= set(meta)


# ---- the shard files ------------------------------------------------------------------

def shard_format(shard: dict) -> int:
    """What the file itself says it is: 3 with an identity, 2 with checksums, else 1."""
    return 3 if "identity" in shard else 2 if "checksums" in shard else 1


def shard_problem(shard, rank: int, meta: dict) -> str | None:
    """What keeps a loaded shard file (rank `rank`'s, by its name) from being a shard of
    the checkpoint `meta` describes: its structure, then its identity."""
    if type(shard) is not dict or not {"pieces", "scalars", "rng", "rank"} <= set(shard):
        return "not a minidist shard file (no pieces, scalars, rng or rank)"
    fmt = shard_format(shard)
    if fmt != meta["format"]:  # decided by the files: an edit cannot skip a checksum
        return (f"the file is format {fmt} and meta.json says format {meta['format']}"
                + (": meta.json was edited to skip the checks" if fmt > meta["format"] else ""))
    if type(shard["rank"]) is not int or shard["rank"] != rank:
        return f"holds rank {shorten(shard['rank'])}'s shard, under rank {rank}'s name"
    pieces, scalars, rng = shard["pieces"], shard["scalars"], shard["rng"]
    if type(pieces) is not list or type(scalars) is not dict or type(rng) is not dict:
        return "not a minidist shard file (pieces, scalars or rng of the wrong type)"
    for p in pieces:
        if not (type(p) in (list, tuple) and len(p) == 4 and type(p[0]) is str
                and type(p[1]) in (list, tuple) and len(p[1]) <= 16
                and all(type(n) is int and n >= 0 for n in p[1])
                and type(p[2]) is int and p[2] >= 0 and torch.is_tensor(p[3]) and p[3].dim() == 1):
            return f"a piece is not (key, shape, start, 1-D tensor): {shorten(p)}"
    for k, v in scalars.items():
        if type(k) is not str or not (torch.is_tensor(v) or v is None or type(v) in (int, float, bool)):
            return f"scalar {shorten(k)} is not a tensor or a number"
    if not all(type(k) is str and torch.is_tensor(v) and v.dtype == torch.uint8 for k, v in rng.items()):
        return "an RNG state is not a byte tensor"
    if fmt == 1:
        return None
    sums = shard["checksums"]
    if not (type(sums) is dict and type(sums.get("pieces")) is list and len(sums["pieces"]) == len(pieces)
            and all(type(c) is int for c in sums["pieces"])
            and type(sums.get("scalars")) is dict and set(sums["scalars"]) == set(scalars)
            and type(sums.get("rng")) is dict and set(sums["rng"]) == set(rng)):
        return "its checksums do not list what it holds"
    if fmt == 2:
        return None
    want = {"id": meta["id"], "step": meta["step"], "rank": rank, "world_size": meta["world_size"]}
    ident = shard["identity"]
    try:
        sealed = type(ident) is dict and sums.get("seal") == seal(ident, sums)
    except (TypeError, ValueError):  # an identity that is not plain numbers and strings
        sealed = False
    if not sealed:
        return "its identity and checksums do not match their seal (edited or damaged)"
    if ident != want:
        diff = [f"{k} {shorten(ident.get(k))} (this checkpoint: {v!r})" for k, v in want.items()
                if ident.get(k) != v]
        return f"belongs to another checkpoint: {'; '.join(diff) or 'other fields'}"
    return None


def coverage_problem(key: str, shape: tuple, pieces: list) -> str | None:
    """Whether the pieces [(start, 1-D tensor)] of tensor `key` cover each of its elements
    exactly once, in one dtype: so a shape is bounded by the bytes on disk."""
    spans = sorted((s, s + t.numel()) for s, t in pieces if t.numel())
    end = 0
    for a, b in spans:
        if a != end:
            return f"tensor {key}: " + ("pieces overlap" if a < end else f"elements [{end}, {a}) are in no piece")
        end = b
    if end != math.prod(shape):
        return f"tensor {key}: its pieces hold {end} elements, its shape {list(shape)} needs {math.prod(shape)}"
    if len({t.dtype for _, t in pieces}) != 1:
        return f"tensor {key}: pieces of several dtypes"
    return None
