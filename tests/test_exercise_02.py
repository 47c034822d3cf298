"""Exercise 02's grader: torch's collectives score 0 on the parts that call them, naming the
line; a ring going left loses the direction check only; the slips lose their checks; a ring
that deadlocks fails within the timeout. Each variant is tests/solutions/02_collectives.py
with functions defined again at its end (the later one wins), graded once on 3 ranks (the
smallest ring where left differs from right). tests/test_exercises.py grades the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from exercises.grader import core
from exercises.grader import checks_02 as C

SOLUTION = (Path(__file__).parent / "solutions" / "02_collectives.py").read_text()

VARIANTS = {
    "collectives": '''
def ring_all_gather(chunks):  # torch's all_gather, every chunk padded to the largest
    mine = chunks[dist.get_rank()]
    mine = torch.nn.functional.pad(mine, (0, max(c.numel() for c in chunks) - mine.numel()))
    out = [torch.empty_like(mine) for _ in chunks]
    dist.all_gather(out, mine)  # all_gather
    for c, o in zip(chunks, out):
        c.copy_(o[:c.numel()])


def all_reduce(tensor):
    dist.all_reduce(tensor)  # all_reduce
    return tensor
''',
    "going left": '''
def ring_reduce_scatter(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        acc = chunks[(r + k + 2) % n]
        buf = torch.empty_like(acc)
        _exchange(chunks[(r + k + 1) % n], (r - 1) % n, buf, (r + 1) % n)  # send
        acc.add_(buf)


def ring_all_gather(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        _exchange(chunks[(r + k) % n], (r - 1) % n, chunks[(r + k + 1) % n], (r + 1) % n)
''',
    "through rank 0": '''
def all_reduce(tensor):
    r, n = dist.get_rank(), dist.get_world_size()
    if r == 0:
        buf = torch.empty_like(tensor)
        for src in range(1, n):
            dist.recv(buf, src)
            tensor.add_(buf)
        for dst in range(1, n):
            dist.send(tensor, dst)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
    return tensor
''',
    "no add on the last step": '''
def ring_reduce_scatter(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        acc = chunks[(r - k - 2) % n]
        buf = torch.empty_like(acc)
        _exchange(chunks[(r - k - 1) % n], (r + 1) % n, buf, (r - 1) % n)
        acc.copy_(buf) if k == n - 2 else acc.add_(buf)
''',
    "blocking send first": '''
def ring_all_gather(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for k in range(n - 1):
        dist.send(chunks[(r - k) % n], (r + 1) % n)
        dist.recv(chunks[(r - k - 1) % n], (r - 1) % n)
''',
}
RS, AG, FP32, BF16, DIRECTION, BYTES = (c.name for c in core.checks_of("02"))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{variant: ({failed check: message}, the variant's file)}, each graded once."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C, "WORLD_SIZES", (3,))
        mp.setattr(C, "TIMEOUT_S", 3.0)  # the deadlock costs 3 s, not 20
        for name, tail in VARIANTS.items():
            path = tmp_path_factory.mktemp("ex02") / f"{name.replace(' ', '_')}.py"
            path.write_text(SOLUTION + "\n" + tail)
            r = core.grade("02", path=path)
            out[name] = {c.name: c.message for c in r.checks if not c.ok}, path
    return out


def _line(path, marker):
    lines = path.read_text().splitlines()
    return f"/{path.name}:{next(i for i, ln in enumerate(lines, 1) if ln.rstrip().endswith(marker))}"


def test_torchs_collectives_score_0_on_the_parts_that_call_them_naming_the_line(graded):
    failed, path = graded["collectives"]
    assert set(failed) == {AG, FP32, BF16, DIRECTION, BYTES}, failed  # reduce-scatter keeps its points
    assert "dist.all_gather was called at" in failed[AG] and _line(path, "# all_gather") in failed[AG]
    for name in (FP32, BF16, BYTES):
        assert "dist.all_reduce was called at" in failed[name], failed[name]
        assert _line(path, "# all_reduce") in failed[name], failed[name]
    for msg in failed.values():
        assert "which this exercise forbids" in msg and "dist.isend, irecv, send and recv" in msg, msg


def test_a_ring_going_left_loses_the_direction_check_only(graded):
    failed, path = graded["going left"]
    assert set(failed) == {DIRECTION}, failed
    msg = failed[DIRECTION]
    assert msg.startswith("ring_reduce_scatter on 3 ranks: rank 0"), msg
    assert ("received from rank 1" in msg and "receives only from rank 2" in msg) or \
        ("to rank 2" in msg and "sends only to rank 1" in msg), msg


def test_all_to_rank_0_and_back_sums_right_but_is_no_ring(graded):
    failed, _ = graded["through rank 0"]
    assert set(failed) == {DIRECTION, BYTES}, failed
    assert failed[DIRECTION].startswith("all_reduce on 3 ranks: rank 0"), failed
    assert "rank 0 (28 bytes): sent 56 bytes" in failed[BYTES], failed  # (N-1) * S of 7 floats


def test_a_lost_contribution_fails_the_sums(graded):
    failed, _ = graded["no add on the last step"]
    assert set(failed) == {RS, FP32, BF16}, failed
    for msg in failed.values():
        assert "the sum over ranks is" in msg, msg


def test_a_deadlocking_ring_fails_within_the_timeout(graded):
    failed, _ = graded["blocking send first"]
    assert set(failed) == {AG, FP32, BF16, DIRECTION, BYTES}, failed  # reduce-scatter ran first
    assert "timed out" in failed[AG] and "more than 3s" in failed[AG], failed[AG]
    for name in (FP32, BF16, BYTES):
        assert "the part before it hung" in failed[name], failed[name]
