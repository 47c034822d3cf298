"""Hostile or odd input refused up front, each named (issue 35): a FIFO or a device given
to any reader (--config, --data, a token shard, a play of the corpus, a vocabulary file's
hash, the data cache) is refused by kind before it is opened, so nothing blocks; --config
is read bounded; an error caused by a --config value names the file and the key; every
switch has a --no- form, so the command line overrides the file. (Every number flag's
range: tests/test_reliability.py; the benchmarks' options: tests/test_bench.py.)"""

import contextlib
import os
import signal

import pytest

from minidist import data
from minidist.files import NotARegularFile
from minidist.run.flags import build_parser, parse_args, resolve_args


@contextlib.contextmanager
def _no_hang(seconds=30):
    """A read that blocks fails its test instead of hanging the suite."""
    def stop(*_):
        raise TimeoutError(f"still blocked after {seconds} s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _special(path, kind):
    """A FIFO, or a link to a character device, at `path` (a reader follows links)."""
    os.mkfifo(path) if kind == "fifo" else os.symlink("/dev/zero", path)
    return path


def _exit_2(capsys, fn, *args):
    """The last line fn(*args) writes as it exits 2 (argparse: usage, then one line)."""
    with pytest.raises(SystemExit) as e:
        fn(*args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def _cache(tmp_path, kind, monkeypatch, capsys):
    """The data cache with a special file for meta.json: found damaged and written again."""
    monkeypatch.setattr(data, "corpus_split", lambda split: [f"{split}: to be, or not to be.\n"] * 3)
    meta = data.prepare_shakespeare(tmp_path, "gpt2-512")
    (tmp_path / "meta.json").unlink()
    _special(tmp_path / "meta.json", kind)
    assert data.prepare_shakespeare(tmp_path, "gpt2-512") == meta
    assert "is damaged" in capsys.readouterr().out and (tmp_path / "meta.json").is_file()


READERS = {  # reader: a call on a special file at `p` that must refuse it, naming it
    "--config": lambda p, capsys: _exit_2(capsys, parse_args, ["--config", str(p)]),
    "--data": lambda p, capsys: _exit_2(capsys, resolve_args, build_parser().parse_args(
        ["--device", "cpu", "--data", str(p), "--val-data", str(p), "--out-dir", str(p.parent / "out")]), 1),
    "token shard": lambda p, capsys: data.read_shard(p),
    "play": lambda p, capsys: data.play_text(p),
    "vocabulary file": lambda p, capsys: data._sha256(p),
}


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("reader", [*READERS, "data cache"])
def test_a_special_file_is_refused_by_kind_by_every_reader(reader, kind, tmp_path, monkeypatch, capsys):
    said = {"fifo": "is a FIFO (named pipe), not a regular file", "device": "is a character device"}[kind]
    with _no_hang():
        if reader == "data cache":
            return _cache(tmp_path, kind, monkeypatch, capsys)
        p = _special(tmp_path / "x.bin", kind)
        try:
            line = READERS[reader](p, capsys)
        except NotARegularFile as e:
            line = str(e)
    assert str(p) in line and said in line, line
    if reader.startswith("--"):
        assert line.split(": error: ")[1].startswith(reader), line


@pytest.mark.parametrize("make, says", [
    (lambda p: p.mkdir(), "is a folder, not a regular file"),
    (lambda p: os.truncate(p.write_bytes(b"") or p, 2**20 + 1), "holds 1,048,577 bytes, more than the 1,048,576"),
    (lambda p: p.write_text("steps = " + "[" * 100_000), "nested too deeply to read"),
    (lambda p: p.write_text("steps = " + "[" * 50 + "]" * 50), "...]]]]]]]: --steps takes one number or word"),
], ids=["a folder", "over a MiB", "nested 100,000 deep", "a nested value, said short"])
def test_a_config_file_is_read_bounded(make, says, tmp_path, capsys):
    make(tmp_path / "c.toml")
    line = _exit_2(capsys, parse_args, ["--config", str(tmp_path / "c.toml")])
    assert f"--config {tmp_path / 'c.toml'}" in line and says in line, line


def test_the_command_line_overrides_a_files_switch_and_a_files_error_names_it(tmp_path, capsys):
    switches = [a for a in build_parser()._actions if a.nargs == 0 and a.dest != "help"]
    assert len(switches) >= 2 and all(f"--no-{a.dest.replace('_', '-')}" in a.option_strings for a in switches)
    cfg = tmp_path / "run.toml"
    cfg.write_text("sequence_parallel = true\ndebug_collectives = false\nbatch_size = 6\nsteps = 10\n")
    base = ["--config", str(cfg), "--device", "cpu", "--warmup-steps", "2", "--out-dir", str(tmp_path / "out")]
    assert parse_args(base).sequence_parallel is True
    assert parse_args([*base, "--debug-collectives"]).debug_collectives is True  # true beats the file's false
    args = resolve_args(parse_args([*base, "--no-sequence-parallel"]), 1)  # false beats the file's true
    assert (args.sequence_parallel, args.batch_size) == (False, 6)
    line = _exit_2(capsys, resolve_args, parse_args(base), 1)
    assert line.endswith(f"error: --config {cfg}: key sequence_parallel: --sequence-parallel splits over the "
                         "tensor-parallel ranks: add --tp 2 or more"), line
    line = _exit_2(capsys, resolve_args, parse_args([*base, "--no-sequence-parallel"]), 4)
    assert f"error: --config {cfg}: key batch_size: --batch-size 6 does not divide across 4" in line, line
    line = _exit_2(capsys, resolve_args, parse_args([*base, "--no-sequence-parallel", "--batch-size", "7"]), 4)
    assert ": error: --batch-size 7 does not divide" in line, line  # the command line's own value: no file named
