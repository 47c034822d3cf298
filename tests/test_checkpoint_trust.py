"""Checkpoint files are trusted only when whole (minidist.checkpoint, minidist.checkpoint.io):
a meta.json that is valid JSON but not a checkpoint's, or whose sizes are absurd, is
damaged, quickly and without allocating what it claims; a format downgrade cannot skip a
checksum; a shard file from another checkpoint is damage; rotation deletes only what
minidist wrote and never the newest good checkpoint; a step past the run's end is
refused; the loss scaler's settings are the resuming run's; nothing non-finite is ever
saved; and no checkpoint file can make a read block (a FIFO). One process, tiny models, small files: the rules, not one case each.
(The cases that need several ranks, a renamed rank's file and the non-finite check agreed
across ranks, are in tests/test_checkpoint.py's 2-rank test.)"""

import contextlib
import json
import math
import os
import shutil
import threading
import time
import tracemalloc
import zlib

import pytest
import torch

from minidist import checkpoint
from minidist.checkpoint import io as checkpoint_io
from minidist.checkpoint import schema as checkpoint_schema
from minidist.checkpoint.resume import find_resume
from minidist.run import checkpoints as checkpoints_cli
from minidist.run import outputs
from minidist.checkpoint.schema import to_json
from minidist.scaler import LossScaler


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    return model, opt


def _fresh():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, [torch.optim.AdamW(model.parameters(), lr=1e-2)]


def _saved(root, steps=(1, 2), **kw):
    """A model and AdamW after one step, saved at `steps` under root: (model, opt, paths)."""
    model, opt = _model_and_opt()
    paths = [checkpoint.save(root, s, model, [opt], **kw) for s in steps]
    return model, opt, paths


def _write_meta(path, meta, recompute=True):
    """Write meta.json as a careful forger would: any content, its checksum recomputed."""
    if recompute and isinstance(meta, dict):
        meta = {k: v for k, v in meta.items() if k != "checksum"}
        meta["checksum"] = zlib.crc32(to_json(meta, sort_keys=True).encode())
    (path / "meta.json").write_text(json.dumps(meta))


def _meta(path):
    return json.loads((path / "meta.json").read_text())


def _rewrite_shard(f, edit):
    """Load a shard file, edit it, store it again with its checksums (and seal) recomputed:
    what a copy or an edit by someone who knows the format leaves."""
    shard = torch.load(f, weights_only=True)
    edit(shard)
    try:
        shard["checksums"] = checkpoint_io.shard_checksums(shard) if "checksums" in shard else None
    except (KeyError, TypeError):  # an edit that leaves nothing to checksum
        pass
    if isinstance(shard, dict) and shard.get("checksums", 0) is None:
        shard.pop("checksums")
    torch.save(shard, f)


def _assert_damaged(path, root, capsys, *needles):
    """The rule for a damaged checkpoint, every way it is met: verify names it, load refuses
    it with a CheckpointError, the inspector says DAMAGED (exit 1, no traceback), and
    --resume auto skips it with a line and takes the checkpoint before it."""
    problems = checkpoint.verify(path)
    assert len(problems) == 1 and all(n in problems[0] for n in needles), problems
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(path, *_fresh())
    with pytest.raises(SystemExit) as e:
        checkpoints_cli.main([str(path)])
    assert e.value.code == 1 and f"{path}: DAMAGED" in capsys.readouterr().out
    assert find_resume("auto", root, {}) == root / "step_00000001"
    assert f"skipping {path.name}, damaged" in capsys.readouterr().err


# ---- a. meta.json: a schema before anything is built from it -----------------------------

NOT_A_CHECKPOINTS = [
    ("{}", "no 'format'"), ("null", "this is null"), ("[]", "this is a list"), ("[1, 2]", "a list"),
    ('"step"', "a string"), ("3", "a number"), ("[" * 100000 + "]" * 100000, "not readable JSON"),
    ('{"format": NaN}', "not readable JSON"), ("\xff\xfe", "not readable JSON"),
]

EDITS = [  # (what to change in a good meta.json, checksum recomputed; what the message says)
    (lambda m: m.update(world_size=10 ** 9), "'world_size' must be an integer in [1, 1048576]"),
    (lambda m: m.update(world_size=0), "'world_size' must be"),
    (lambda m: m.update(world_size="1"), "'world_size' must be"),
    (lambda m: m.update(world_size=True), "'world_size' must be"),
    (lambda m: m.update(step=-1), "'step' must be"),
    (lambda m: m.update(step=2.0), "'step' must be"),
    (lambda m: m.update(step=10 ** 30), "'step' must be"),
    (lambda m: m.pop("step"), "no 'step'"),
    (lambda m: m.update(format="3"), "'format' must be an integer"),
    (lambda m: m.update(format=99), "format 99 is newer"),
    (lambda m: m.update(optimizers={}), "'optimizers' must be a list"),
    (lambda m: m.update(optimizers=[1]), "optimizers[0] must be"),
    (lambda m: m.update(optimizers=[{"param_groups": 5}]), "optimizers[0] must be"),
    (lambda m: m["optimizers"][0]["param_groups"][0].update(lr="fast"), "param_groups[0].lr must be"),
    (lambda m: m["optimizers"][0]["param_groups"][0].update(eps=-1.0), "param_groups[0].eps must be"),
    (lambda m: m["optimizers"][0]["param_groups"][0].update(betas={"a": 1}), "betas must be"),
    (lambda m: m.update(scaler=[]), "'scaler' must be"),
    (lambda m: m.update(scaler={"scale": 2.0}), "'scaler' must be"),
    (lambda m: m.update(extra=[]), "'extra' must be an object"),
    (lambda m: m.update(extra={"settings": []}), "extra.settings must be"),
    (lambda m: m.update(extra={"settings": {"preset": ["tiny"]}}), "extra.settings.preset"),
    (lambda m: m.update(extra={"rows": {"step": 1}}), "extra.rows must be"),
    (lambda m: m.update(extra={"settings": {"steps": 1}}), "past the end of the run that saved it"),
    (lambda m: m.update(id="0" * 31), "'id' must be 32 hex digits"),
    (lambda m: m.update(kind="something else"), "'kind' must be"),
    (lambda m: m.update(surprise=1), "unknown field 'surprise'"),
]


@pytest.mark.parametrize("text, says", NOT_A_CHECKPOINTS, ids=lambda v: repr(v)[:20])
def test_valid_or_invalid_json_that_is_not_a_checkpoints_is_damaged(tmp_path, capsys, text, says):
    root = tmp_path / "checkpoints"
    _, _, (_, two) = _saved(root)
    (two / "meta.json").write_bytes(text.encode("latin-1"))
    _assert_damaged(two, root, capsys, "meta.json", says)


@pytest.mark.parametrize("edit, says", EDITS, ids=[s for _, s in EDITS])
def test_a_meta_json_outside_the_schema_is_damaged_even_with_its_checksum(tmp_path, capsys, edit, says):
    root = tmp_path / "checkpoints"
    _, _, (_, two) = _saved(root, scaler=LossScaler())
    meta = _meta(two)
    edit(meta)
    _write_meta(two, meta)
    _assert_damaged(two, root, capsys, "meta.json", says)


def test_absurd_sizes_are_refused_quickly_without_building_them(tmp_path, capsys, monkeypatch):
    """A world size of 10^9 (or the largest the schema allows, 2^20, against one file on
    disk): damaged at once, not a list of a billion names; a meta.json larger than any
    checkpoint's is not read at all."""
    root = tmp_path / "checkpoints"
    _, _, (_, two) = _saved(root)
    for world, says in ((10 ** 9, "'world_size' must be"),
                        (checkpoint_schema.MAX_WORLD, "incomplete, 1 shard files for a checkpoint saved by 1048576")):
        _write_meta(two, {**_meta(two), "world_size": world})
        tracemalloc.start()
        t0 = time.perf_counter()
        problems = checkpoint.verify(two)
        with pytest.raises(SystemExit):
            checkpoints_cli.main([str(root)])
        took, (_, peak) = time.perf_counter() - t0, tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert says in problems[0] and f"{two}: DAMAGED" in capsys.readouterr().out, problems
        assert took < 2 and peak < 20e6, (took, peak)
    monkeypatch.setattr(checkpoint_io, "MAX_META_BYTES", 1000)
    _write_meta(two, {**_meta(two), "world_size": 1, "extra": {"note": "x" * 2000}})
    assert "more than the 1,000 such a file can hold" in checkpoint.verify(two)[0]


def test_shards_outside_the_schema_are_damaged(tmp_path, capsys):
    """The shard files' contents are checked too, and a tensor's shape is bounded by the
    elements its pieces hold: a shape of 10^12 elements is damage, not an allocation."""
    root = tmp_path / "checkpoints"
    _, _, (_, two) = _saved(root)
    f = next(two.glob("shard_*.pt"))
    good = f.read_bytes()

    def huge(shard):
        key, _, start, t = shard["pieces"][0]
        shard["pieces"][0] = (key, (10 ** 12,), start, t)

    def gap(shard):
        key, shape, start, t = shard["pieces"][0]
        shard["pieces"][0] = (key, shape, start + 1, t[1:])

    for edit, says in ((huge, "its shape [1000000000000] needs"), (gap, "elements [0, 1) are in no piece"),
                       (lambda s: s.__setitem__("pieces", 7), "pieces, scalars or rng of the wrong type"),
                       (lambda s: s.pop("rng"), "not a minidist shard file"),
                       (lambda s: s["pieces"].append(("model/x", (2,), 0, torch.zeros(2, 2))),
                        "not (key, shape, start, 1-D tensor)")):
        _rewrite_shard(f, edit)
        problems = checkpoint.verify(two)
        assert len(problems) == 1 and says in problems[0], problems
        f.write_bytes(good)
    torch.save([1, 2, 3], f)  # not even a dict
    _assert_damaged(two, root, capsys, f.name, "not a minidist shard file")


# ---- b. the files decide the format --------------------------------------------------------

def test_a_format_downgrade_cannot_skip_the_checksums(tmp_path, capsys):
    """The issue's case: a hand-edited step, meta.json declaring an older format so that its
    checksum is not asked for. The shards carry format 3: damaged, whatever meta.json says."""
    root = tmp_path / "checkpoints"
    _, _, (_, two) = _saved(root)
    edited = tmp_path / "edited"  # (not named step_*: the folder's name cannot give it away)
    for fmt, drop, says in ((1, ("checksum", "kind", "id"), "the file is format 3 and meta.json says format 1"),
                            (2, ("kind", "id"), "the file is format 3 and meta.json says format 2"),
                            (2, (), "declares format 2 but carries format 3's identity"),
                            (1, ("checksum",), "declares format 1 but carries format 3's identity")):
        shutil.rmtree(edited, ignore_errors=True)
        shutil.copytree(two, edited)
        meta = {k: v for k, v in _meta(two).items() if k not in drop}
        meta.update(format=fmt, step=7)
        _write_meta(edited, meta, recompute=fmt >= 2)
        problems = checkpoint.verify(edited)
        assert len(problems) == 1 and says in problems[0], problems
        with pytest.raises(checkpoint.CheckpointError, match="format"):
            checkpoint.load(edited, *_fresh())


def test_older_formats_still_load_with_the_checks_they_allow(tmp_path):
    """A format-2 checkpoint (checksums, no identity) and a format-1 one (neither), as older
    minidist wrote them, still load; a format-2 meta.json over format-2 shards is checked."""
    root = tmp_path / "checkpoints"
    model, _, (one, _) = _saved(root)
    f = next(one.glob("shard_*.pt"))
    for fmt in (2, 1):
        def older(shard):
            shard.pop("identity", None)
            if fmt == 1:
                shard.pop("checksums")
        _rewrite_shard(f, older)
        meta = {k: v for k, v in _meta(one).items() if k not in ("kind", "id", "checksum")}
        _write_meta(one, {**meta, "format": fmt}, recompute=fmt == 2)
        assert checkpoint.verify(one) == []
        fresh = _fresh()
        assert checkpoint.load(one, *fresh)["step"] == 1
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh[0].parameters()))
    _write_meta(one, {**_meta(one), "format": 2})  # format-1 shards under a format-2 meta.json
    assert "the file is format 1 and meta.json says format 2" in checkpoint.verify(one)[0]


# ---- c. each shard file is bound to its checkpoint ----------------------------------------

def test_a_shard_from_another_checkpoint_is_damage(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _, _, (one, two) = _saved(root)
    name = next(two.glob("shard_*.pt")).name
    assert "(checksums and identity verified)" in (checkpoints_cli.main([str(two)]) or capsys.readouterr().out)
    # from the checkpoint before it, in the same run: intact by its own checksums
    shutil.copy(one / name, two / name)
    _assert_damaged(two, root, capsys, name, "belongs to another checkpoint", "step 1 (this checkpoint: 2)")
    # the same step saved again elsewhere, the same weights: only the id differs
    model, opt = _model_and_opt()
    again = checkpoint.save(tmp_path / "again", 2, model, [opt])
    shutil.copy(again / name, two / name)
    _assert_damaged(two, root, capsys, name, "belongs to another checkpoint", "id '")
    # its identity edited to match, without its seal: edited or damaged
    ident = torch.load(two / name, weights_only=True)
    ident["identity"]["id"] = _meta(two)["id"]
    torch.save(ident, two / name)
    _assert_damaged(two, root, capsys, name, "do not match their seal")


# ---- d. rotation deletes only what minidist wrote -----------------------------------------

def test_rotation_deletes_only_checkpoints_minidist_wrote(tmp_path):
    root = tmp_path / "checkpoints"
    model, opt = _model_and_opt()
    first = checkpoint.save(root, 2, model, [opt], keep=0)
    users = [root / "step_00000002.good", root / "step_00000003_backup", root / "step_2",
             root / "step_000000001", root / ".backup_step_00000001"]
    for u in users:  # the user's copies, every one with a meta.json of a checkpoint
        shutil.copytree(first, u)
    mine_by_name = root / "step_00000001"  # named as minidist names, but not minidist's
    mine_by_name.mkdir()
    (mine_by_name / "meta.json").write_text('{"note": "my own notes"}')
    junk = root / ".tmp_step_00000009"  # what a killed save leaves: deleted
    junk.mkdir()
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000001", "step_00000002"]
    for step in (3, 4, 5):
        checkpoint.save(root, step, model, [opt], keep=1)
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [u.name for u in users] + ["step_00000001", "step_00000005"])
    assert (mine_by_name / "meta.json").read_text() == '{"note": "my own notes"}'
    # an older step saved into a folder with newer ones: the one just saved is kept
    checkpoint.save(root, 3, model, [opt], keep=1)
    assert {"step_00000003", "step_00000005"} <= {p.name for p in root.iterdir()}
    # a folder in the way that minidist did not write is refused, not replaced
    with pytest.raises(RuntimeError, match="step_00000001 exists and is not a checkpoint minidist wrote"):
        checkpoint.save(root, 1, model, [opt])
    assert (mine_by_name / "meta.json").read_text() == '{"note": "my own notes"}'


def test_a_diverged_state_never_replaces_the_good_checkpoint(tmp_path):
    """g and d together: with keep=1, a save of NaN weights is refused, so the good
    checkpoint stays the newest and is kept."""
    root = tmp_path / "checkpoints"
    model, opt = _model_and_opt()
    good = checkpoint.save(root, 2, model, [opt], keep=1)
    with torch.no_grad():
        model[1].bias[0] = math.nan
    with pytest.raises(checkpoint.NonFiniteCheckpointError):
        checkpoint.save(root, 3, model, [opt], keep=1)
    assert checkpoint.list_checkpoints(root) == [good] and checkpoint.verify(good) == []
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]  # nothing half-written


# ---- e. a step past the run's end ------------------------------------------------------

def test_a_step_past_the_end_of_the_run_is_refused(tmp_path):
    root = tmp_path / "checkpoints"
    model, opt = _model_and_opt()
    path = checkpoint.save(root, 100, model, [opt])
    message = f"checkpoint {path} at step 100 is past --steps 50: raise --steps or start fresh"
    with pytest.raises(checkpoint.CheckpointPastEndError) as e:
        checkpoint.check_step(path, 50)
    assert str(e.value) == message
    assert isinstance(e.value, ValueError)  # what flags turns into a usage error (exit 2)
    fresh = _fresh()
    before = [p.detach().clone() for p in fresh[0].parameters()]
    with pytest.raises(checkpoint.CheckpointPastEndError, match="step 100 is past --steps 50"):
        checkpoint.load(path, *fresh, total_steps=50)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh[0].parameters()))  # nothing changed
    checkpoint.check_step(path, 100)  # at the end: the run only evaluates
    assert checkpoint.load(path, *_fresh(), total_steps=100)["step"] == 100


# ---- f. the loss scaler's settings are the resuming run's --------------------------------

def _drive(scaler, overflows):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    for bad in overflows:
        p.grad = torch.full((1,), math.inf if bad else 1.0)
        scaler.step(opt)
        scaler.update()


def test_loss_scaler_settings_change_on_resume_its_state_does_not(tmp_path):
    saved = LossScaler(init_scale=1024.0, growth_interval=2000, hysteresis=1)
    _drive(saved, [True, False, False, False, False, False])  # 1024 -> 512, then 5 clean steps
    model, opt = _model_and_opt()
    path = checkpoint.save(tmp_path, 6, model, [opt], saved)
    # --loss-scale-growth-interval 4 --loss-scale-hysteresis 3 --loss-scale-init 2**16 now
    resumed = LossScaler(init_scale=2.0 ** 16, growth_interval=4, hysteresis=3)
    checkpoint.load(path, *_fresh(), resumed)
    state = resumed.state_dict()
    assert (state["growth_interval"], state["hysteresis"]) == (4, 3)  # the flags' values
    assert state["scale"] == 512.0 and state["skipped_steps"] == 1  # the run's own state
    assert state["growth_tracker"] == 3  # 5 clean steps already: the next one grows
    _drive(resumed, [False])
    assert resumed.get_scale() == 1024.0
    _drive(resumed, [True, True])  # hysteresis 3: two overflows do not back off yet
    assert resumed.get_scale() == 1024.0
    # and the same settings as saved: the exact trajectory of the uninterrupted scaler
    again = LossScaler(growth_interval=2000, hysteresis=1)
    checkpoint.load(path, *_fresh(), again)
    assert again.state_dict() == saved.state_dict()


# ---- g. nothing non-finite is ever saved ----------------------------------------------------

def test_non_finite_weights_optimizer_state_or_loss_scale_are_never_saved(tmp_path):
    root = tmp_path / "checkpoints"
    for where, what, key in (("weight", "model", "model/0.weight"),
                             ("exp_avg", "optimizer 0", "optim0/0.weight/exp_avg"),
                             ("scale", "loss scale", None)):
        model, opt = _model_and_opt()
        scaler = LossScaler()
        if where == "weight":
            with torch.no_grad():
                model[0].weight[1, 2] = math.inf
        elif where == "exp_avg":
            opt.state[model[0].weight]["exp_avg"][0, 0] = math.nan
        else:
            scaler._scale = math.inf  # (a scaler never gets here by itself: what if it did)
        with pytest.raises(checkpoint.NonFiniteCheckpointError) as e:
            checkpoint.save(root, 1, model, [opt], scaler)
        assert e.value.what == [what] and e.value.step == 1, e.value.what
        assert f"{what} not finite" in str(e.value) and "diverged" in str(e.value)
        if key:
            assert key in str(e.value)
        assert isinstance(e.value, FloatingPointError)
        assert not root.exists() or list(root.iterdir()) == []  # nothing written, nothing left
    # inf gradients (an fp16 step the scaler skipped) are not saved, and do not matter
    model, opt = _model_and_opt()
    for p in model.parameters():
        p.grad = torch.full_like(p, math.inf)
    assert checkpoint.verify(checkpoint.save(root, 1, model, [opt], LossScaler())) == []


def test_the_cli_has_help_takes_one_path_and_finds_a_runs_checkpoints(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        checkpoints_cli.main(["--help"])
    assert e.value.code == 0 and "Verify minidist checkpoints" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        checkpoints_cli.main([str(tmp_path), "extra"])
    assert e.value.code == 2 and "unrecognized arguments: extra" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        checkpoints_cli.main([str(tmp_path)])
    assert "name a run's OUT_DIR, its OUT_DIR/checkpoints" in str(e.value.code)


# ---- h. nothing a checkpoint holds can make a read block ----------------------------------

@contextlib.contextmanager
def _let_go(fifos, after_s=30.0):
    """A guard, not a timing: if a read blocks on one of `fifos` (the bug), it is let go
    after `after_s` (a writer opens each, which ends a blocked open), so the test fails
    instead of hanging the suite. Yields the list of those it had to let go."""
    let_go = []

    def rescue():
        for f in fifos:
            let_go.append(f.name)
            os.close(os.open(f, os.O_RDWR | os.O_NONBLOCK))
    timer = threading.Timer(after_s, rescue)
    timer.start()
    try:
        yield let_go
    finally:
        timer.cancel()


def test_checkpoint_files_that_are_fifos_are_refused_by_kind_never_read(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    model, opt, (one, two) = _saved(root)
    three = checkpoint.save(root, 3, model, [opt], keep=0)
    shard, meta = two / "shard_00000_of_00001.pt", three / "meta.json"
    for f in (shard, meta):
        f.unlink()
        os.mkfifo(f)
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "summary.json")
    with _let_go([shard, meta, out / "summary.json"]) as let_go:
        assert checkpoint.verify(two) == [f"checkpoint shard {shard} is a FIFO (named pipe), not a regular file"]
        assert checkpoint.verify(three) == [f"meta.json {meta} is a FIFO (named pipe), not a regular file"]
        assert find_resume("auto", root, {}) == one  # the newest whole one, past both
        assert "skipping step_00000002, damaged (checkpoint shard" in capsys.readouterr().err
        for path in (root, three):  # the checkpoint CLI: each named, exit 1
            with pytest.raises(SystemExit) as e:
                checkpoints_cli.main([str(path)])
            assert e.value.code == 1 and "is a FIFO (named pipe)" in capsys.readouterr().out
        assert not checkpoint_schema.written_by_minidist(three)  # rotation never deletes it
        assert outputs.output_problem(out) == (f"{out / 'summary.json'} is a FIFO (named pipe), but the run "
                                               "writes a file there: move it away, or choose another --out-dir")
    assert let_go == []
