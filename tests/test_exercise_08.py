"""Exercise 08's grader catches the mistakes that matter, each in the checks it belongs to.

tests/test_exercises.py grades the stubs (0), minidist (full) and tests/solutions/08_at_scale.py
(full). Here each mistake is that solution with a line or two changed. pieces_of and read are
checked in this process, so their mistakes are graded as overrides, on those checks alone. A
mistake of save or load costs a grading on the ranks, so mistakes that show in different checks
share one file, graded once (each check's message says which mistake it caught).
"""

from pathlib import Path

import pytest

from exercises.grader import core

SOLUTION = (Path(__file__).parent / "solutions" / "08_at_scale.py").read_text()
PIECES, READ, GAPS = "pieces_of:", "read: a range", "read: ValueError"
ATOMIC, BYTES, LOADED, SAME = "save is atomic", "save writes each element", "load on 2 and 3", "resumed on the same"


def _changed(*edits) -> str:
    text = SOLUTION
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


# in-process mistakes: (edits, {check: a phrase of its message}); only those checks may fail
IN_PROCESS = {
    "bucket order": ([("order = sorted(layout, key=lambda e: e[2])", "order = list(layout)")], {PIECES: "want"}),
    "no padding": ([("chunk = -(-sum(numel for _, numel, _ in order) // world)",
                     "chunk = sum(numel for _, numel, _ in order) // world")], {PIECES: "want"}),
    "end included": ([("lo, hi = rank * chunk, (rank + 1) * chunk", "lo, hi = rank * chunk, (rank + 1) * chunk + 1")],
                     {PIECES: "want"}),
    "start counted in the unit": ([("out.append((name, a - offset, a, b))", "out.append((name, a, a, b))")],
                                  {PIECES: "want"}),
    "piece offset forgotten": ([("t[a - s:b - s]", "t[a:b]")], {READ: "raised", GAPS: "raised"}),
    "no gap check": ([("    if not covered.all():", "    if False:")], {GAPS: "want ValueError"}),
}
# mistakes of save and load, grouped by the checks they show in
ON_RANKS = {
    "in place, slices not cloned, only its own shard of the weights read, rank 0's RNG on every rank": (
        [('tmp = final.with_name(".tmp_" + final.name)', "tmp = final"),
         ("u.flat[a:b].clone()", "u.flat[a:b]"),
         ('''        for name, p in model.named_parameters():  # replicated: every rank reads them whole
            p.view(-1).copy_(read(pieces, f"model/{name}", 0, p.numel()))''', '''        for u in opt.units:
            for name, start, a, b in pieces_of(layout_of(u, names), rank, world):
                u.flat[a:b] = read(pieces, f"model/{name}", start, b - a)'''),
         ('f["rank"] == rank', 'f["rank"] == 0')],
        {ATOMIC: "visible, holding", BYTES: "each element once", LOADED: "rank 0's", SAME: "rank(s) [1]"}),
    "leftover kept, rank 0 writes every weight, AdamW's step restarted": (
        [("        shutil.rmtree(tmp, ignore_errors=True)", "        pass"),
         ('            pieces.append((f"model/{name}", start, u.flat[a:b].clone()))\n', ""),
         ('    shard = {"pieces": pieces,', '    pieces += [(f"model/{k}", 0, p.detach().reshape(-1).clone()) '
          'for k, p in model.named_parameters()] if rank == 0 else []\n    shard = {"pieces": pieces,'),
         ('set_shard_state(opt, u, flats, files[0]["scalars"])',
          'set_shard_state(opt, u, flats, {k: 0 * v for k, v in files[0]["scalars"].items()})')],
        {ATOMIC: "saving step 2 again raised", BYTES: "rank 0 wrote", LOADED: "0-dim state", SAME: "rank 0's"}),
}
DCP = "    rank, world = dist.get_rank(), dist.get_world_size()\n    final ="


def _graded(tmp_path, text: str):
    path = tmp_path / "variant.py"
    path.write_text(text)
    return core.grade("08", path=path), path


def _failed(result) -> dict:
    return {c.name: c.message for c in result.checks if not c.ok}


def _assert_fails_exactly(result, must_fail: dict) -> None:
    failed = _failed(result)
    assert sorted(failed) == sorted(c.name for c in result.checks if c.name.startswith(tuple(must_fail))), failed
    for prefix, phrase in must_fail.items():
        msg = next(m for n, m in failed.items() if n.startswith(prefix))
        assert phrase in msg and "not implemented" not in msg, (prefix, msg)


@pytest.mark.parametrize("mistake", list(IN_PROCESS))
def test_a_mistake_of_pieces_of_or_read_loses_its_checks(mistake, monkeypatch):
    edits, must_fail = IN_PROCESS[mistake]
    namespace = {}
    exec(compile(_changed(*edits), "variant", "exec"), namespace)  # noqa: S102 - our own solution, changed
    which = "pieces_of" if PIECES in must_fail else "read"
    monkeypatch.setitem(core.CHECKS, "08", [c for c in core.checks_of("08") if c.name.startswith((PIECES, "read"))])
    r = core.grade("08", reference=True, overrides={which: namespace[which]})
    _assert_fails_exactly(r, must_fail)


@pytest.mark.parametrize("mistakes", list(ON_RANKS))
def test_mistakes_of_save_and_load_lose_their_checks(mistakes, tmp_path):
    edits, must_fail = ON_RANKS[mistakes]
    r, _ = _graded(tmp_path, _changed(*edits))
    _assert_fails_exactly(r, must_fail)
    assert r.points == sum(c.max_points for c in r.checks if not c.name.startswith(tuple(must_fail)))


def test_torch_distributed_checkpoint_scores_0_on_the_parts_that_call_it(tmp_path):
    text = _changed((DCP, "    import torch.distributed.checkpoint as dcp\n    dcp.save({'w': torch.zeros(1)}, "
                          "checkpoint_id=str(root))\n" + DCP))
    r, path = _graded(tmp_path, text)
    line = text.splitlines().index("    dcp.save({'w': torch.zeros(1)}, checkpoint_id=str(root))") + 1
    failed = _failed(r)
    assert sorted(failed) == sorted(c.name for c in r.checks if c.name.startswith((ATOMIC, BYTES, LOADED, SAME)))
    for name, msg in failed.items():
        assert "torch.distributed.checkpoint.save was called" in msg and f"{path.name}:{line}" in msg, (name, msg)
        assert "own sharded format" in msg, msg
    assert r.points == 4 + 2 + 1  # pieces_of and read keep theirs
