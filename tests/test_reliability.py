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
import shutil

import pytest
import torch

from minidist import checkpoint, data, faults, metrics
from minidist.flags import MAY_CHANGE_ON_RESUME, build_parser, find_resume, resolve_args
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
        checkpoint.main([str(root)])
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
    assert _strict(metrics.to_json({"a": float("nan"), "b": [1.5, float("-inf")]})) == \
        {"a": None, "b": [1.5, None]}
    rows = metrics.MetricsFile(tmp_path / "m.jsonl", [{"step": 1, "loss": 2.0}])
    rows.append({"step": 2, "loss": float("nan")})
    lines = (tmp_path / "m.jsonl").read_text().splitlines()  # flushed: readable before close
    assert [_strict(line) for line in lines] == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": None}]
    assert rows[1]["loss"] != rows[1]["loss"]  # in memory the run keeps its NaN
    rows.close()


def test_loss_watch_stops_after_consecutive_non_finite_steps():
    args = build_parser().parse_args(["--lr", "0.1", "--warmup-steps", "0", "--tokenizer", "gpt2"])
    watch = metrics.LossWatch(args)
    for step, loss in enumerate([3.0, float("nan"), float("nan"), 2.5, float("inf"), float("nan")], 1):
        watch.check(step, loss)  # two in a row, then finite: no stop
    with pytest.raises(metrics.NonFiniteLoss, match=r"step 7: .*steps 5-7.*--lr 0.1.*--precision"):
        watch.check(7, float("nan"))


# ---- inputs checked before any work ----------------------------------------------------

def _resolve(tmp_path, *argv, world=2):
    base = ["--device", "cpu", "--steps", "10", "--warmup-steps", "2", "--batch-size", "4", "--out-dir", str(tmp_path / "out")]
    return resolve_args(build_parser().parse_args(base + list(argv)), world)


@pytest.mark.parametrize("argv, env, message", [
    (["--lr", "nan"], None, "--lr must be a finite number >= 0, got nan"),
    (["--lr", "inf"], None, "--lr must be a finite number >= 0, got inf"),
    (["--weight-decay", "-0.1"], None, "--weight-decay must be a finite number >= 0"),
    (["--grad-clip", "inf"], None, "--grad-clip must be a finite number"),
    (["--seq-len", "512"], None, "--seq-len 512 is longer than the tiny preset's context (128"),
    (["--n-head", "3"], None, "--n-layer/--n-head/--n-embd: n_embd=128 must be divisible by n_head=3"),
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

    # 3. a learning rate that makes the loss non-finite: every rank stops at the same step
    try:
        train_gpt.main(ARGV + ["--steps", "12", "--lr", "1e30", "--out-dir", f"{tmp}/nan"])
    except metrics.NonFiniteLoss as e:
        got["nan"] = str(e)

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
    stopped = int(r0["nan"].split(":")[0].split()[1])
    rows = [_strict(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, stopped))  # every step logged before the stop
    assert rows[-1]["loss"] is None and rows[-2]["loss"] is None  # two non-finite, as null
    resumed = (tmp_path / "resume" / "metrics.jsonl").read_text().splitlines()
    assert len(resumed) == r0["rows"]  # restored rows, then the new ones: one run's file
    assert _strict((tmp_path / "resume" / "summary.json").read_text())["val_loss"] > 0
    assert "within 2 s" in r0["timeout"] and "rank 1 did not reach" in r0["timeout"]
