"""A run's outputs tell the truth (chapter 08): its --out-dir says a run is in progress from
its first write, so a killed run never leaves an earlier run's ending; a run moves another
run's outputs aside (saying where) rather than replace them; summary.json, loss.png and metrics.jsonl are never cut or
empty, a full disk included; a failed save cleans up and names the OS error; a damaged
newest checkpoint that --resume auto skipped is moved aside, so the run saves that step and
ends 0. In this process: train_gpt.main(argv), tiny, with monkeypatch."""

import builtins
import errno
import json
import os
from pathlib import Path

import pytest
import torch

from minidist import checkpoint, train_gpt
from minidist.checkpoint import faults, sharded
from minidist.run import locks, outputs

ONE = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--tokenizer", "gpt2-512",
       "--lr", "3e-3", "--warmup-steps", "1", "--eval-interval", "100", "--eval-windows", "4",
       "--final-eval-windows", "4", "--sample-tokens", "2", "--log-interval", "1", "--device", "cpu",
       "--batch-size", "4", "--optimizer", "adamw"]


def _strict(text):
    def refuse(name):
        raise ValueError(f"{name} is not strict JSON")
    return json.loads(text, parse_constant=refuse)


def _rows(out):
    return [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class Killed(BaseException):
    """Rank 0 lost as by SIGKILL: nothing of the run's own ending runs (only `finally`s)."""


def test_a_killed_run_says_running_and_whatever_is_in_its_way_is_moved_aside(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()  # another run's outputs, no checkpoints (before: replaced without a word)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (out / "summary.json").write_text('{"ended": "completed", "args": {"seed": 7}}')
    argv = ONE + ["--steps", "4", "--checkpoint-every", "2", "--out-dir", str(out)]
    first = train_gpt.main(argv)
    (aside,) = [p for p in out.iterdir() if p.name.startswith("earlier_run_")]
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert f"held another run's metrics.jsonl, summary.json: moved them to {aside}/" in capsys.readouterr().out
    ckpts = out / "checkpoints"
    (ckpts / "step_00000004" / "meta.json").write_text("{}")  # the newest, damaged

    def kill(where, step, rank):
        if where == "step" and step == 3:
            raise Killed()
    monkeypatch.setattr(faults, "inject_fault", kill)
    with pytest.raises(Killed):  # resumed from step 2, killed after step 3
        train_gpt.main(argv + ["--resume", "auto"])
    said = capsys.readouterr()
    # not the earlier run's "completed": this run's own mark, which names it
    summary = _strict((out / "summary.json").read_text())
    assert summary["ended"] == "running" and summary["pid"] == os.getpid()
    assert summary["resumed_from"] == str(ckpts / "step_00000002")
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]  # whole rows: restored, then its own
    # the damaged step 4 it skipped is out of the way, under a name no listing takes, said
    assert (ckpts / "step_00000004.damaged" / "meta.json").read_text() == "{}"
    assert "--resume auto: skipping step_00000004, damaged" in said.err
    assert "moved the damaged step_00000004 it skipped to step_00000004.damaged" in said.out
    assert checkpoint.list_checkpoints(ckpts) == [ckpts / "step_00000002"]
    # the same command again: it saves step 4 where the damaged one was, and ends 0
    monkeypatch.undo()
    again = train_gpt.main(argv + ["--resume", "auto"])
    assert again["ended"] == "completed" and again["val_loss"] == first["val_loss"]
    assert checkpoint.verify(ckpts / "step_00000004") == []
    assert _strict((out / "summary.json").read_text())["ended"] == "completed"
    assert [r.get("loss") for r in _rows(out)] == [r.get("loss") for r in first["rows"]]


def test_another_runs_outputs_are_moved_aside_not_replaced_unless_they_are_this_runs(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (out / "summary.json").write_text(json.dumps({"ended": "running", "run": "torchrun job-a"}))
    # an earlier attempt of this torchrun job (a restart) is its own; another job's is not
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    assert locks.earlier_outputs(out, None) == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert locks.earlier_outputs(out, None) == ["metrics.jsonl", "summary.json"]
    # nor is a run resumed from elsewhere; one resumed from this folder's checkpoints is
    assert locks.earlier_outputs(out, tmp_path / "elsewhere" / "checkpoints" / "step_00000002") != []
    assert locks.earlier_outputs(out, out / "checkpoints" / "step_00000002") == []
    said = []
    locks.take_out_dir(out, None, False, log=said.append)
    (aside,) = [p for p in out.iterdir() if p.name.startswith("earlier_run_")]
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "summary.json"]
    assert list(out.iterdir()) == [aside] and len(said) == 1 and f"moved them to {aside}/" in said[0]


def test_metrics_and_summary_are_never_cut_or_empty(tmp_path, monkeypatch, capsys):
    rows = outputs.MetricsFile(tmp_path / "metrics.jsonl", [{"step": 1}])
    real = os.write
    with monkeypatch.context() as m:  # the disk fills up in the middle of step 2's row
        m.setattr(os, "write", lambda fd, data: real(fd, data[:len(data) // 2]))
        rows.append({"step": 2})
    assert _rows(tmp_path) == [{"step": 1}]  # the cut row taken back off, not left as a row
    assert "metrics.jsonl: the row of step 2 not written" in capsys.readouterr().err
    assert rows.error is not None and rows.error.errno == errno.ENOSPC
    rows.append({"step": 3})  # space again: the row kept in memory goes first
    assert _rows(tmp_path) == [{"step": 1}, {"step": 2}, {"step": 3}] and rows.error is None
    rows.close()

    summary = tmp_path / "summary.json"
    summary.write_text('{"ended": "completed"}')

    def full(self, text, *a, **k):  # some bytes reach the disk, then it is full
        with open(self, "w") as f:
            f.write(text[:5])
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(Path, "write_text", full)
        with pytest.raises(OSError):
            outputs.write_json(summary, {"ended": "failed"})
        assert summary.read_text() == '{"ended": "completed"}'  # the old one whole, no partial left
        assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "summary.json"]
        outputs.mark_running(tmp_path, {"steps": 3})  # not even the mark fits: no stale ending left
        assert not summary.exists()
    outputs.mark_running(tmp_path, {"steps": 3})
    assert _strict(summary.read_text())["ended"] == "running"


def test_a_save_on_a_full_disk_cleans_up_names_it_and_ends_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    model = torch.nn.Linear(2, 2)

    def read_only(path, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(path))
    with monkeypatch.context() as m:
        m.setattr(sharded, "open", read_only, raising=False)
        with pytest.raises(checkpoint.SaveError, match=r"\[Errno 30\] Read-only file system.*"
                                                        "is on a read-only file system: choose another folder"):
            checkpoint.save(tmp_path / "ro", 1, model, [])
    assert list((tmp_path / "ro").iterdir()) == []  # no .tmp_step_ folder left
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here (Linux's always-full device) for a real ENOSPC")
    # a real ENOSPC from the kernel, through torch.save: the shard's bytes go to /dev/full
    real_open = builtins.open
    monkeypatch.setattr(sharded, "open", lambda path, mode="r", *a, **k: real_open("/dev/full", mode), raising=False)
    out = tmp_path / "out"
    with pytest.raises(outputs.RunStopped) as e:
        train_gpt.main(ONE + ["--steps", "3", "--checkpoint-every", "2", "--out-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.exit_code == 1 and len(err) == 1, err
    assert err[0].startswith(f"stopped at step 2: checkpoint {out / 'checkpoints' / 'step_00000002'} was not "
                             "saved (rank 0: [Errno 28] No space left on device"), err
    assert f"free space in {out / 'checkpoints'} or choose another folder" in err[0]
    assert "unexpected pos" not in err[0] and "no checkpoint to resume from" in err[0]
    assert list((out / "checkpoints").iterdir()) == []  # the .tmp_ folder does not keep the disk full
    summary = _strict((out / "summary.json").read_text())
    assert summary["ended"] == "failed" and "No space left on device" in summary["error"]
    assert [r["step"] for r in _rows(out)] == [1, 2]


def test_a_save_on_a_real_tiny_full_file_system():
    where = os.environ.get("FULL_FS_DIR")  # a folder on a file system of a few KB, made by hand
    if not where:
        pytest.skip("a tiny file system takes a mount (root); set FULL_FS_DIR to a folder on one. "
                    "test_a_save_on_a_full_disk_... gets a real ENOSPC from /dev/full instead")
    root = Path(where) / "minidist-full-fs-test"
    with pytest.raises(checkpoint.SaveError, match=r"\[Errno 28\] No space left on device; free space in"):
        checkpoint.save(root, 1, torch.nn.Linear(1000, 1000), [])
    assert not any(p.name.startswith(".tmp_") for p in root.iterdir())
