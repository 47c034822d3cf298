"""Nothing lost, nothing silent (chapter 08's table of bad inputs and faults): a damaged
checkpoint is found and named, and --resume auto falls back to the newest intact one; a
run whose loss stays non-finite stops, naming the step, and leaves strict JSON; bad
flags, folders, shards and MINIDIST_FAULT fail before any work; ranks started with
different flags fail together. Most checks call the validation functions in this
process; one group of 2 launched ranks runs the cases that need a process group."""

import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from minidist import checkpoint, data, dist as mdist
from minidist.checkpoint import faults
from minidist.run import flags, locks, outputs
from minidist.run.flags import MAY_CHANGE_ON_RESUME, build_parser, resolve_args
from minidist.checkpoint.resume import find_resume
from minidist.run import checkpoints as checkpoints_cli
from minidist.launch import launch
from minidist.model import GPT, GPTConfig


def _strict(text):
    """Parse JSON as strict parsers do: NaN and Infinity are errors."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


# ---- checkpoints: checksums, the damage named, the fallback --------------------------

def _tiny_run(root, settings):
    """A tiny GPT and AdamW after one step, saved at steps 1 and 2: (model, optimizer)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 32, (2, 9))
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    for step in (1, 2):
        checkpoint.save(root, step, model, [opt], extra={"settings": settings})
    return model, opt


def _fresh():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    return model, [torch.optim.AdamW(model.parameters(), lr=1e-2)]


def _damage_tensor(path, tensor):
    """Overwrite 16 bytes inside `tensor`'s stored copy in the shard file under `path`."""
    f = next(path.glob("shard_*.pt"))
    raw = bytearray(f.read_bytes())
    at = raw.find(tensor.detach().numpy().tobytes())
    assert at > 0
    raw[at + 4:at + 20] = b"\xa5" * 16
    f.write_bytes(bytes(raw))
    return f


def test_damaged_checkpoints_are_named_and_skipped(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    settings = {"lr": 0.01}
    model, opt = _tiny_run(root, settings)
    one, two = checkpoint.list_checkpoints(root)
    assert checkpoint.verify(two) == [] and checkpoint.load(two, *_fresh())["step"] == 2

    # bytes of one tensor overwritten: the folder, the file and the tensor are named
    f = _damage_tensor(two, next(model.parameters()))
    problems = checkpoint.verify(two)
    assert len(problems) == 1 and str(f) in problems[0] and "tensor model/" in problems[0], problems
    with pytest.raises(checkpoint.CheckpointError, match=f"{two}.*{f.name}.*tensor model/"):
        checkpoint.load(two, *_fresh())
    with pytest.raises(SystemExit) as e:  # the CLI: per checkpoint, intact or damaged and where
        checkpoints_cli.main([str(root)])
    out = capsys.readouterr().out
    assert e.value.code == 1 and f"{one}: intact" in out and f"{two}: DAMAGED" in out and f.name in out

    # --resume auto: one line, and the newest intact checkpoint; a path: refused, named
    assert find_resume("auto", root, settings, MAY_CHANGE_ON_RESUME) == one
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "skipping step_00000002" in err and f.name in err, err
    with pytest.raises(ValueError, match=f"{f}.*damaged"):
        find_resume(str(two), root, settings, MAY_CHANGE_ON_RESUME)

    # the case: 4000 bytes overwritten in the middle of the file
    raw = bytearray((one / f.name).read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 4000] = os.urandom(4000)
    (one / f.name).write_bytes(bytes(raw))
    assert checkpoint.verify(one)
    with pytest.raises(ValueError, match="every checkpoint in .* is damaged"):
        find_resume("auto", root, settings, MAY_CHANGE_ON_RESUME)


def test_incomplete_unreadable_and_edited_checkpoints(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _tiny_run(root, {})
    one, two = checkpoint.list_checkpoints(root)
    shard = next(two.glob("shard_*.pt"))
    shutil.copytree(two, tmp_path / "copy")
    shard.unlink()  # a rank's file is missing
    assert "incomplete" in checkpoint.verify(two)[0] and shard.name in checkpoint.verify(two)[0]
    assert find_resume("auto", root, {}) == one and "skipping step_00000002" in capsys.readouterr().err
    shard.write_bytes(b"PK\x03\x04 cut short")  # a truncated file: torch.load's error, named
    assert f"{shard}: unreadable" in checkpoint.verify(two)[0]
    with pytest.raises(checkpoint.CheckpointError, match="unreadable"):
        checkpoint.load(two, *_fresh())
    meta = json.loads((one / "meta.json").read_text())
    meta["step"] = 7  # a hand edit
    (one / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match="meta.json: its content does not match"):
        checkpoint.read_meta(one)
    assert "meta.json" in checkpoint.verify(one)[0]
    assert checkpoint.verify(tmp_path / "copy") == []  # the intact copy: the checks can pass


@pytest.mark.parametrize("text", ["{}", "null", "[1, 2]", '{"extra": 3}'])
def test_resume_auto_skips_a_meta_json_of_another_shape(text, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _tiny_run(root, {})
    one, two = checkpoint.list_checkpoints(root)
    (two / "meta.json").write_text(text)  # JSON, but not a checkpoint's
    assert find_resume("auto", root, {}) == one
    assert "skipping step_00000002, damaged" in capsys.readouterr().err


def test_a_failed_save_says_what_failed(tmp_path, monkeypatch):
    model, opts = _fresh()
    for errno_, text, says in ((13, "Permission denied", "is not writable"),
                               (28, "No space left on device", "free space")):
        def refuse(*a, **k):
            raise OSError(errno_, text)
        monkeypatch.setattr(torch, "save", refuse)
        with pytest.raises(RuntimeError) as e:
            checkpoint.save(tmp_path, 1, model, opts)
        assert text in str(e.value) and says in str(e.value), str(e.value)
        if errno_ == 13:
            assert "free space" not in str(e.value)
    assert checkpoint.list_checkpoints(tmp_path) == []


# ---- strict JSON, written as the run goes ----------------------------------------------

def test_metrics_are_strict_json_and_written_as_they_come(tmp_path):
    assert _strict(outputs.to_json({"a": float("nan"), "b": [1.5, float("-inf")]})) == \
        {"a": None, "b": [1.5, None]}
    rows = outputs.MetricsFile(tmp_path / "m.jsonl", [{"step": 1, "loss": 2.0}])
    rows.append({"step": 2, "loss": float("nan")})
    lines = (tmp_path / "m.jsonl").read_text().splitlines()  # flushed: readable before close
    assert [_strict(line) for line in lines] == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": None}]
    assert rows[1]["loss"] != rows[1]["loss"]  # in memory the run keeps its NaN
    rows.close()


def test_loss_watch_stops_after_consecutive_non_finite_steps():
    args = build_parser().parse_args(["--lr", "0.1", "--warmup-steps", "0", "--tokenizer", "gpt2"])
    watch = outputs.LossWatch(args)
    for step, loss in enumerate([3.0, float("nan"), float("nan"), 2.5, float("inf"), float("nan")], 1):
        watch.check(step, loss)  # two in a row, then finite: no stop
    with pytest.raises(outputs.NonFiniteLoss, match=r"step 7: .*steps 5-7.*--lr 0.1.*--precision"):
        watch.check(7, float("nan"))


# ---- inputs checked before any work ----------------------------------------------------

def _resolve(tmp_path, *argv, world=2):
    base = ["--device", "cpu", "--steps", "10", "--warmup-steps", "2", "--batch-size", "4", "--out-dir", str(tmp_path / "out")]
    return resolve_args(build_parser().parse_args(base + list(argv)), world)


@pytest.mark.parametrize("argv, env, message", [
    (["--lr", "nan"], None, "argument --lr: must be a finite number > 0, at most 1e+30"),
    (["--lr", "inf"], None, "argument --lr: must be a finite number > 0, at most 1e+30"),
    (["--weight-decay", "-0.1"], None, "argument --weight-decay: must be a finite number >= 0"),
    (["--grad-clip", "inf"], None, "argument --grad-clip: must be a finite number"),
    (["--seq-len", "512"], None, "--seq-len 512 is longer than the tiny preset's context (128"),
    (["--n-head", "3"], None, "--n-layer/--n-head/--n-embd: n_embd=128 must be divisible by n_head=3"),
    # each in its range, together 53 trillion parameters: refused before a rank allocates them
    (["--n-layer", "1024", "--n-embd", "65536"], None, "parameters, whose fp32 weights and gradients alone take"),
    (["--dp", "flat", "--zero-stage", "1"], None, "--dp flat with --zero-stage 1"),
    (["--dp", "naive", "--zero-stage", "3"], None, "--dp naive with --zero-stage 3"),
    ([], "kill:step:x", "MINIDIST_FAULT='kill:step:x' is not kill:step|save:STEP:RANK"),
    ([], "kill:stop:3:1", "is not kill:step|save:STEP:RANK"),
])
def test_bad_numbers_and_combinations_are_refused(tmp_path, monkeypatch, capsys, argv, env, message):
    monkeypatch.setenv("MINIDIST_FAULT", env or "")
    with pytest.raises(SystemExit) as e:
        _resolve(tmp_path, "--preset", "tiny", *argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_out_dir_is_checked_first(tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("")
    for out, message in ((tmp_path / "afile", "is a file, not a folder"),
                         (tmp_path / "afile" / "sub", "cannot be written")):
        with pytest.raises(SystemExit):
            resolve_args(build_parser().parse_args(["--device", "cpu", "--out-dir", str(out)]), 1)
        assert message in capsys.readouterr().err
    import tempfile

    def refuse(*a, **k):  # what a folder without write permission does (root ignores chmod)
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    with pytest.raises(SystemExit):
        _resolve(tmp_path)
    assert "cannot be written (Permission denied)" in capsys.readouterr().err


def test_token_ids_beyond_the_vocabulary_are_found_at_load(tmp_path, capsys):
    shard = tmp_path / "fineweb_train_000001.bin"
    data.write_shard(shard, list(range(3000)) * 2)  # GPT-2 ids, up to 2999
    with pytest.raises(ValueError, match="token id 2999 is beyond the vocabulary \\(2048 tokens\\)"):
        data.TokenLoader(shard, 16, 2, vocab_size=2048)
    data.TokenLoader(shard, 16, 2, vocab_size=50257)  # the right tokenizer: fine
    with pytest.raises(SystemExit):
        _resolve(tmp_path, "--tokenizer", "gpt2-2048", "--data", str(shard), "--val-data", str(shard))
    err = capsys.readouterr().err
    assert str(shard) in err and "2999" in err and "2048" in err and "--tokenizer gpt2" in err


def test_resume_compares_resolved_values(tmp_path, capsys):
    saved = vars(_resolve(tmp_path, "--preset", "tiny"))
    assert saved["n_layer"] == 4  # what the tiny preset builds
    root = tmp_path / "out" / "checkpoints"
    checkpoint.save(root, 2, torch.nn.Linear(2, 2), [], extra={"settings": {**saved, "n_layer": None}})
    # --n-layer 4 on tiny is the same model (saved as None by an older run, or as 4)
    assert _resolve(tmp_path, "--preset", "tiny", "--n-layer", "4", "--resume", "auto").resume
    with pytest.raises(SystemExit):
        _resolve(tmp_path, "--preset", "tiny", "--n-layer", "2", "--resume", "auto")
    assert "n_layer: 4 saved, 2 now" in capsys.readouterr().err


# ---- every input, a table of bad values each: exit 2 and one line naming it --------------

def _numeric_flags():
    """Every flag that takes a number: build_parser's actions whose type checks a range."""
    p = build_parser()
    return [a.option_strings[0] for a in p._actions
            if a.option_strings and a.type is not None and a.dest not in ("zero_stage", "out_dir")]


def test_every_number_flag_has_a_range():
    # the rule, not a list: no flag reads a bare int or float (which take nan, inf, -1), and
    # every range has a top (a count without one takes --batch-size 10**11: a MemoryError later)
    actions = [a for a in build_parser()._actions if a.option_strings[0] in _numeric_flags()]
    bare = [a.option_strings[0] for a in build_parser()._actions if a.type in (int, float)]
    assert not bare, f"flags without a range: {bare}"
    assert not [a.option_strings[0] for a in actions if getattr(a.type, "high", None) is None]
    assert len(actions) >= 25


@pytest.mark.parametrize("flag", _numeric_flags())
def test_every_number_flag_refuses_what_no_run_can_use(flag, capsys):
    for bad in ("nan", "-1", "x", "1e999", str(10**40), "1e300"):
        if flag == "--bucket-cap-mb" and bad in ("1e999", str(10**40), "1e300"):
            continue  # inf: one bucket for everything (and more MiB than there are: the same)
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([flag, bad])
        last = capsys.readouterr().err.strip().splitlines()[-1]  # usage, then the one line
        assert e.value.code == 2 and f": error: argument {flag}: must be" in last and repr(bad) in last, last


BAD_FLAGS = {  # flag: values that must be refused, and what the message must say
    "--steps": (["0", "-3", "2.5", "ten", str(10**12)], "an integer >= 1, at most 1000000000"),
    "--batch-size": (["0", "-4", str(10**11), "1e11"], "an integer >= 1, at most 1048576 (sequences)"),
    "--seed": (["-1", str(2**64), str(2**63), "1e3"], "an integer in [0, 2**63)"),
    "--lr": (["0", "-1", "nan", "inf", "-inf", "1e300"], "a finite number > 0, at most 1e+30"),
    "--dropout": (["1", "-0.1", "nan"], "a number in [0, 1)"),
    "--min-lr-ratio": (["1.5", "-1"], "a number in [0, 1]"),
    "--warmup-steps": (["-1"], "an integer >= 0"),
    "--checkpoint-every": (["-1", "1.5"], "an integer >= 0"),
    "--keep-checkpoints": (["0"], "an integer >= 1"),
    "--zero-stage": (["4", "x", "-1"], "0, 1, 2, 3"),
    "--grad-accum-steps": (["0", "x"], "an integer >= 1"),
    "--memory-budget-gb": (["0", "nan", "-2"], "a finite number > 0"),
    "--loss-scale-init": (["0", "0.5", "inf", "1e300"], "a number from 1 to fp32's largest"),
    "--out-dir": (["", " "], "is empty: name a folder"),
    "--bucket-cap-mb": (["-1", "nan"], "a number of MiB >= 0"),
    "--n-head": (["0"], "an integer >= 1"),
    "--sample-tokens": (["-1", str(10**11)], "an integer >= 0, at most 100000"),
}


@pytest.mark.parametrize("flag", sorted(BAD_FLAGS))
def test_bad_flag_values(flag, tmp_path, capsys):
    values, says = BAD_FLAGS[flag]
    for bad in values:
        with pytest.raises(SystemExit) as e:
            _resolve(tmp_path, f"{flag}={bad}")  # (= so that argparse reads -inf as a value)
        err = capsys.readouterr().err
        assert e.value.code == 2 and flag in err and says in err, (bad, err)


def _a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    return str(f)


BAD_ENV = [  # (variable, value or a function of tmp_path making one), the message's words
    ("MINIDIST_TIMEOUT", "abc", "finite number of seconds > 0"),
    ("MINIDIST_FIGURES", "yes", "use 1 (on) or 0 (off)"),
    ("MINIDIST_TIMEOUT", "nan", "finite number of seconds > 0"),
    ("MINIDIST_TIMEOUT", "inf", "finite number of seconds > 0"),
    ("MINIDIST_TIMEOUT", "-5", "finite number of seconds > 0"),
    ("MINIDIST_TIMEOUT", "0", "finite number of seconds > 0"),
    ("MINIDIST_FAULT", "kill:step:x:1", "kill:step|save:STEP:RANK"),
    ("MINIDIST_DEVICE", "gpu", "'cpu' or 'cuda'"),
    ("MINIDIST_DATA", _a_file, "is a file, not a folder"),
    ("WORLD_SIZE", "two", "integer >= 1"),
    ("WORLD_SIZE", "0", "integer >= 1"),
    ("WORLD_SIZE", "2", "is set but RANK is not: start the run with torchrun"),  # RANK unset here
]


@pytest.mark.parametrize("name, value, says", BAD_ENV, ids=[f"{n}={v if isinstance(v, str) else 'file'}"
                                                             for n, v, _ in BAD_ENV])
def test_bad_environment(name, value, says, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(name, value(tmp_path) if callable(value) else value)
    with pytest.raises(SystemExit) as e:
        _resolve(tmp_path)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{name}=" in err and says in err, err


def test_every_environment_variable_minidist_reads_is_checked():
    # the package's own reads of MINIDIST_*: each one has its check in flags.ENVIRONMENT
    import re
    from conftest import ROOT
    read = set()
    for f in (ROOT / "minidist").rglob("*.py"):
        read |= set(re.findall(r"environ(?:\.get)?[\[(]\"(MINIDIST_\w+)\"", f.read_text()))
    assert read and read <= set(flags.ENVIRONMENT), read - set(flags.ENVIRONMENT)
    with pytest.raises(ValueError, match="MINIDIST_TIMEOUT='-5'"):
        with _env(MINIDIST_TIMEOUT="-5"):
            mdist.default_timeout_s()


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _meta(text):
    def make(tmp_path):
        d = tmp_path / "ckpt"
        d.mkdir()
        (d / "meta.json").write_text(text)
        return str(d)
    return make


def _a_run(tmp_path):
    """A run's out-dir holding one (empty) checkpoint folder: what --resume must not take."""
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True, exist_ok=True)
    (step / "meta.json").write_text("{}")
    return str(tmp_path / "run")


BAD_FILES = [  # (flags, each a string or a function of tmp_path), the message's words
    (["--data", lambda t: str(t), "--val-data", lambda t: str(t)], "--data: "),
    (["--resume", _a_file], "a file, not a checkpoint folder"),
    (["--resume", lambda t: str(t / "nowhere")], "not a complete minidist checkpoint"),
    (["--resume", lambda t: str(t)], "not a complete minidist checkpoint"),
    (["--resume", _meta("{}")], "--resume"),
    (["--resume", _meta("null")], "--resume"),
    (["--resume", _meta("[1, 2]")], "--resume"),
    (["--resume", _meta("{not json")], "--resume"),
    (["--resume", _a_run], "holds checkpoints but is not one: name one, e.g. --resume"),
    (["--resume", lambda t: str(_a_run(t)) + "/checkpoints"], "holds checkpoints but is not one"),
]


def test_a_config_file_that_is_not_text_is_named(tmp_path, capsys):
    from minidist.run.flags import parse_args
    (tmp_path / "c.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(tmp_path / "c.toml")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "c.toml: not valid TOML: not UTF-8 text" in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, says", BAD_FILES, ids=range(len(BAD_FILES)))
def test_bad_files_named_on_the_command_line(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _resolve(tmp_path, *[a(tmp_path) if callable(a) else a for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err, err


@pytest.mark.parametrize("path, kind", [("summary.json", "dir"), ("metrics.jsonl", "dir"),
                                        ("loss.png", "dir"), ("checkpoints", "file")])
def test_every_output_path_is_checked_before_the_first_step(path, kind, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / path).mkdir() if kind == "dir" else (out / path).write_text("")
    with pytest.raises(SystemExit) as e:
        _resolve(tmp_path, "--checkpoint-every", "5")
    err = capsys.readouterr().err
    assert e.value.code == 2 and str(out / path) in err and ("is a folder" if kind == "dir" else "is a file") in err


# ---- one run per output folder ------------------------------------------------------------

_HOLDER = ("import fcntl, json, os, sys, time\n"  # another run's rank 0, as acquire_lock holds it
           "f = open(os.path.join(sys.argv[1], 'run.lock'), 'a+')\n"
           "fcntl.flock(f, fcntl.LOCK_EX)\n"
           "f.truncate(0); f.write(json.dumps({'pid': os.getpid(), 'host': 'here', "
           "'command': 'python minidist/train_gpt.py --the-other-run'})); f.flush()\n"
           "print('holding', flush=True); time.sleep(120)\n")


def test_one_run_per_out_dir(tmp_path, monkeypatch, capsys):
    from minidist import train_gpt
    out = tmp_path / "out"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "holding"
        # a second run on the folder: refused before any work, naming the holder
        with pytest.raises(SystemExit) as e:
            train_gpt.main(["--device", "cpu", "--steps", "2", "--warmup-steps", "1", "--out-dir", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--out-dir {out} is in use by another run (pid {other.pid}" in err, err
        assert "--the-other-run" in err and not dist.is_initialized()
        with pytest.raises(locks.OutDirInUse, match=f"pid {other.pid}"):
            locks.acquire_lock(out, wait_s=0.2)
    finally:
        other.kill()
        other.wait()
    # killed, its lock file is left behind, but the kernel has dropped its lock: stale
    assert (out / "run.lock").exists() and locks.lock_holder(out) is None
    held = locks.acquire_lock(out)
    assert json.loads((out / "run.lock").read_text())["pid"] == os.getpid()
    with pytest.raises(SystemExit):  # held by this process: a second run here is refused too
        _resolve(tmp_path)
    assert "is in use by another run" in capsys.readouterr().err
    locks.release_lock(held)
    assert not (out / "run.lock").exists()
    assert _resolve(tmp_path).out_dir == str(out)

    # the ranks of one run (torchrun's run id, the same on every node and every restart)
    # do not trip on their rank 0's lock; another torchrun job does
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    held = locks.acquire_lock(out)
    assert locks.lock_holder(out) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert locks.lock_holder(out)["run"] == "torchrun job-a"
    locks.release_lock(held)


def test_resume_from_elsewhere_into_another_runs_folder(tmp_path, capsys):
    settings = vars(_resolve(tmp_path, "--preset", "tiny"))
    here, elsewhere = tmp_path / "out" / "checkpoints", tmp_path / "elsewhere" / "checkpoints"
    for root in (here, elsewhere):
        checkpoint.save(root, 2, torch.nn.Linear(2, 2), [], extra={"settings": settings})
    with pytest.raises(SystemExit) as e:
        _resolve(tmp_path, "--preset", "tiny", "--checkpoint-every", "2", "--resume", str(elsewhere / "step_00000002"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds checkpoints of another run" in err and "another --out-dir" in err
    # told where to write (an --out-dir of its own), or resuming this folder's own: accepted
    args = resolve_args(build_parser().parse_args(
        ["--device", "cpu", "--steps", "10", "--warmup-steps", "2", "--batch-size", "4", "--preset", "tiny",
         "--checkpoint-every", "2", "--out-dir", str(tmp_path / "new"), "--resume", str(elsewhere / "step_00000002")]), 2)
    assert args.resume == str(elsewhere / "step_00000002")
    assert _resolve(tmp_path, "--preset", "tiny", "--checkpoint-every", "2",
                    "--resume", str(here / "step_00000002")).resume


# ---- a diverged, stopped or failed run: what it leaves and what it says --------------------

ONE = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--tokenizer", "gpt2-512",
       "--lr", "3e-3", "--warmup-steps", "1", "--eval-interval", "100", "--eval-windows", "4",
       "--final-eval-windows", "4", "--sample-tokens", "2", "--log-interval", "1", "--device", "cpu",
       "--batch-size", "4", "--optimizer", "adamw"]  # (AdamW: no Newton-Schulz, quicker)


def _at_step(monkeypatch, step, what):
    """The forward_backward train_gpt's step calls (minidist.compose.build's PlainStep), and
    from optimizer step `step` of this run on, `what`:
    "nan" (a parameter and the loss non-finite), "weights" (a parameter only: the loss
    stays finite), "SIGTERM" (the signal, sent to this process) or "lost" (a collective
    fails as when a peer has died)."""
    from minidist.compose import build
    real, calls = build.forward_backward, []

    def forward_backward(model, *a, **k):
        loss = real(model, *a, **k)
        calls.append(loss)
        if len(calls) >= step:
            if what in ("nan", "weights"):
                with torch.no_grad():  # the update reads it: the weights stay non-finite
                    next(model.parameters()).view(-1)[0] = float("nan")
                return float("nan") if what == "nan" else loss
            if what == "SIGTERM" and len(calls) == step:
                os.kill(os.getpid(), signal.SIGTERM)
            if what == "lost":
                raise dist.DistBackendError("[gloo] Connection closed by peer [127.0.0.1]:29500")
        return loss
    monkeypatch.setattr(build, "forward_backward", forward_backward)


def _rows(out):
    return [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("what, since", [("nan", 3), ("weights", 4)])
def test_a_run_that_diverges_in_its_last_steps_keeps_its_good_checkpoint(what, since, tmp_path, monkeypatch, capsys):
    # non-finite from step 3 (loss and weights) or 4 (weights only) of 4: too few steps for
    # the loss watch, yet no checkpoint is written from them, and with --keep-checkpoints 1
    # the good one (the step before) stays. The run ends non-zero, naming the step and that
    # checkpoint.
    from minidist import train_gpt
    out = tmp_path / "out"
    _at_step(monkeypatch, since, what)
    with pytest.raises(outputs.NonFiniteLoss) as e:
        train_gpt.main(ONE + ["--steps", "4", "--checkpoint-every", "1", "--keep-checkpoints", "1",
                              "--out-dir", str(out)])
    assert e.value.exit_code == 1 and not dist.is_initialized()
    good = out / "checkpoints" / f"step_{since - 1:08d}"
    assert checkpoint.list_checkpoints(out / "checkpoints") == [good]
    err = capsys.readouterr().err
    line = [l for l in err.splitlines() if "diverged" in l]
    assert len(line) == 1 and f"non-finite at step {since}" in line[0], err
    assert str(good) in line[0] and "--resume auto" in line[0]
    assert "--lr" in line[0] and "bf16" in line[0] and "--loss-scale-init" in line[0]
    summary = _strict((out / "summary.json").read_text())
    assert summary["ended"] == "diverged" and summary["diverged_at_step"] == since
    assert summary["checkpoint"] == str(good)
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]
    assert not (out / "run.lock").exists()  # released, however the run ended


def test_sigterm_stops_at_a_step_saves_and_says_how_to_resume(tmp_path, monkeypatch, capsys):
    from minidist import train_gpt
    out = tmp_path / "out"
    argv = ONE + ["--steps", "5", "--checkpoint-every", "100", "--out-dir", str(out)]
    _at_step(monkeypatch, 2, "SIGTERM")
    with pytest.raises(outputs.RunStopped) as e:
        train_gpt.main(argv)
    assert e.value.exit_code == 128 + signal.SIGTERM and not dist.is_initialized()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers put back
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stopped at step 2 by SIGTERM"), err
    saved = out / "checkpoints" / "step_00000002"  # the stop saved the step it stopped at
    assert checkpoint.list_checkpoints(out / "checkpoints") == [saved] and str(saved) in err[0]
    summary = _strict((out / "summary.json").read_text())
    assert summary["ended"] == "interrupted" and summary["stopped_at_step"] == 2
    assert [r["step"] for r in _rows(out)] == [1, 2]
    # the command it printed resumes the run, which ends as a whole one
    command = shlex.split(err[0].split("resume: ")[1])
    assert command[:2] == ["python", "minidist/train_gpt.py"] and command[-2:] == ["--resume", "auto"]
    monkeypatch.undo()
    done = train_gpt.main(command[2:])
    assert done["ended"] == "completed" and [r["step"] for r in done["rows"] if "loss" in r] == [1, 2, 3, 4, 5]


def test_a_lost_rank_ends_with_one_line_and_a_summary(tmp_path, monkeypatch, capsys):
    from minidist import train_gpt
    out = tmp_path / "out"
    _at_step(monkeypatch, 3, "lost")
    with pytest.raises(outputs.RunStopped):
        train_gpt.main(ONE + ["--steps", "5", "--checkpoint-every", "2", "--out-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped in step 3: a collective failed" in err[0], err
    assert str(out / "checkpoints" / "step_00000002") in err[0] and "--resume auto" in err[0]
    summary = _strict((out / "summary.json").read_text())
    assert summary["ended"] == "failed" and "Connection closed" in summary["error"]


def test_the_script_ends_a_diverged_run_with_its_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    # the script itself (its __main__), run in this process: a learning rate that makes the
    # loss non-finite from step 2 of 3 ends it with status 1 and the line, not a traceback
    import runpy
    from conftest import ROOT
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["train_gpt.py", *ONE, "--lr", "1e30", "--steps", "3", "--out-dir", str(out)])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "minidist" / "train_gpt.py"), run_name="__main__")
    said = capsys.readouterr()
    assert e.value.code == 1 and said.err.count("the run diverged") == 1 and "val loss" not in said.out
    assert _strict((out / "summary.json").read_text())["ended"] == "diverged"


# ---- in one group of 2 ranks: flags that differ, a diverging run, a fallback, a timeout ----

ARGV = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--tokenizer",
        "gpt2-512", "--lr", "3e-3", "--warmup-steps", "1", "--eval-interval", "100",
        "--eval-windows", "4", "--final-eval-windows", "4", "--sample-tokens", "2",
        "--log-interval", "1", "--device", "cpu", "--batch-size", "4"]


def _in_one_group(tmp):
    import torch.distributed as dist
    from minidist import train_gpt
    train_gpt.cleanup = lambda: None  # several runs share this group: none may end it
    rank, got = dist.get_rank(), {}

    # 1. different flags on the two ranks: both fail at start-up, naming them
    mine = ARGV + (["--lr", "1e-3", "--eval-interval", "50"] if rank == 1 else [])
    try:
        train_gpt.main(mine + ["--steps", "2", "--out-dir", f"{tmp}/differ"])
    except ValueError as e:
        got["differ"] = str(e)

    # 2. an interrupted run's newest checkpoint damaged: --resume auto takes the one before
    #    and ends where the uninterrupted run ends
    run = ARGV + ["--steps", "4", "--checkpoint-every", "2", "--out-dir", f"{tmp}/resume"]
    whole = train_gpt.main(run)
    if rank == 0:
        f = f"{tmp}/resume/checkpoints/step_00000004/shard_00001_of_00002.pt"
        raw = bytearray(open(f, "rb").read())
        raw[len(raw) // 2:len(raw) // 2 + 4000] = bytes(4000)
        open(f, "wb").write(bytes(raw))
    dist.barrier()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        again = train_gpt.main(run + ["--resume", "auto"])
    got["skipped"] = err.getvalue()
    got["same"] = ([r.get("loss") for r in again["rows"]] == [r.get("loss") for r in whole["rows"]]
                   and again["val_loss"] == whole["val_loss"])
    got["rows"] = len(whole["rows"])

    # 3. a learning rate that makes the loss non-finite: every rank stops at the same step,
    #    rank 0 alone saying so, in one line
    said = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
        try:
            train_gpt.main(ARGV + ["--steps", "12", "--lr", "1e30", "--out-dir", f"{tmp}/nan"])
        except outputs.NonFiniteLoss as e:
            got["nan"] = str(e)
    got["nan said"] = said.getvalue()

    # 4. the collective tracer waits MINIDIST_TIMEOUT for a peer (rank 1 never comes)
    os.environ["MINIDIST_TIMEOUT"] = "2"
    if rank == 0:
        faults.trace_collectives()
        try:
            dist.barrier()
        except faults.CollectiveMismatch as e:
            got["timeout"] = str(e)
        finally:
            faults.stop_tracing()
    return got


def test_in_one_group_differing_flags_diverging_loss_fallback_and_timeout(tmp_path):
    r0, r1 = launch(_in_one_group, 2, str(tmp_path), timeout_s=240)
    for r in (r0, r1):  # every rank fails at once, with the same message
        assert "--lr: 0.003 on rank 0, 0.001 on rank 1" in r["differ"], r.get("differ")
        assert "--eval-interval: 100 on rank 0, 50 on rank 1" in r["differ"]
        assert r["same"], "the resumed run does not end where the uninterrupted one ends"
        assert r["nan"] == r0["nan"] and "--lr 1e+30" in r["nan"]
    assert "--resume auto: skipping step_00000004, damaged" in r0["skipped"]
    assert r0["skipped"].count("\n") == 1 and r1["skipped"] == ""
    stopped = int(r0["nan"].split("step ")[1].split(":")[0])
    rows = [_strict(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, stopped + 1))  # every step, the stop's too
    assert [r["loss"] for r in rows[-3:]] == [None] * 3  # three non-finite, as null
    assert r0["nan said"].count("\n") == 1 and r0["nan"] in r0["nan said"] and r1["nan said"] == ""
    assert "no checkpoint to resume from" in r0["nan"] and "torchrun --nproc_per_node=2" in r0["nan"]
    summary = _strict((tmp_path / "nan" / "summary.json").read_text())
    assert summary["ended"] == "diverged" and summary["stopped_at_step"] == stopped
    resumed = (tmp_path / "resume" / "metrics.jsonl").read_text().splitlines()
    assert len(resumed) == r0["rows"]  # restored rows, then the new ones: one run's file
    assert _strict((tmp_path / "resume" / "summary.json").read_text())["val_loss"] > 0
    assert "within 2 s" in r0["timeout"] and "rank 1 did not reach" in r0["timeout"]
