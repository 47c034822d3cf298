"""The dp x tp x pp mesh (chapter 10): every rank's three groups are the lines of the grid
through it, and each group's collectives reach exactly its members."""

import pytest
import torch
import torch.distributed as dist

from minidist.compose import mesh


def test_axis_groups_partition_the_world_along_each_axis():
    for dp, tp, pp in [(1, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (2, 2, 2), (3, 2, 2)]:
        world = dp * tp * pp
        lines = mesh.axis_groups(dp, tp, pp)
        for axis, size in (("dp", dp), ("tp", tp), ("pp", pp)):
            assert sorted(r for g in lines[axis] for r in g) == list(range(world))
            assert all(len(g) == size for g in lines[axis])
        for r in range(world):
            a, b, c = mesh.coords(r, dp, tp, pp)
            assert mesh.rank_at(a, b, c, dp, tp) == r
            # along an axis only that axis's coordinate changes
            for axis, k in (("pp", 0), ("dp", 1), ("tp", 2)):
                g = next(g for g in lines[axis] if r in g)
                others = [mesh.coords(s, dp, tp, pp) for s in g]
                assert all(o[:k] + o[k + 1:] == (a, b, c)[:k] + (a, b, c)[k + 1:] for o in others)
                assert sorted(o[k] for o in others) == list(range(len(g)))
    assert mesh.axis_groups(2, 2)["tp"] == [[0, 1], [2, 3]]  # tp varies fastest
    assert mesh.axis_groups(2, 2)["dp"] == [[0, 2], [1, 3]]


@pytest.mark.parametrize("world, tp, pp, phrase", [(4, 3, 1, "not a multiple of tp x pp = 3 x 1"),
                                                   (6, 2, 2, "start a multiple of 4 ranks"),
                                                   (4, 0, 1, "--tp must be a whole number >= 1")])
def test_sizes_that_do_not_fit_say_what_to_change(world, tp, pp, phrase):
    with pytest.raises(ValueError, match=phrase):
        mesh.check_sizes(world, tp, pp)


def _sums(tp, pp):
    m = mesh.make_mesh(tp=tp, pp=pp)
    out = {}
    for axis in ("dp", "tp", "pp"):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=getattr(m, f"{axis}_group"))
        out[axis] = t.item()
    return (m.dp_rank, m.tp_rank, m.pp_rank), out


def test_each_group_reaches_exactly_its_line(pool):
    for tp, pp in [(2, 1), (2, 2)]:
        world = 4
        dp = world // (tp * pp)
        lines = mesh.axis_groups(dp, tp, pp)
        for r, (where, sums) in enumerate(pool(world).run(_sums, tp, pp)):
            pp_rank, dp_rank, tp_rank = mesh.coords(r, dp, tp, pp)
            assert where == (dp_rank, tp_rank, pp_rank)
            for axis in ("dp", "tp", "pp"):
                assert sums[axis] == sum(next(g for g in lines[axis] if r in g))


def _cp_lines(cp):
    m = mesh.make_mesh(cp=cp)
    out = {}
    for axis in ("dp", "cp", "dp_cp"):
        t = torch.tensor([2.0 ** dist.get_rank()])  # a sum of distinct powers names its ranks
        dist.all_reduce(t, group=getattr(m, f"{axis}_group"))
        out[axis] = sorted(i for i in range(dist.get_world_size()) if int(t.item()) >> i & 1)
    return (m.dp, m.cp, m.dp_rank, m.cp_rank), out, m.describe()


def test_a_cp_axis_splits_dp_into_dp_x_cp_cp_fastest(pool):
    """Chapter 12: 4 ranks at cp 2 are dp 2 x cp 2; a replica's cp ranks are neighbours, the
    dp group holds one rank per slice position, and the gradient's group is all four."""
    for r, (where, lines, said) in enumerate(pool(4).run(_cp_lines, 2)):
        assert where == (2, 2, r // 2, r % 2)
        assert lines == {"cp": [r - r % 2, r - r % 2 + 1], "dp": [r % 2, r % 2 + 2], "dp_cp": [0, 1, 2, 3]}
        assert said == "dp 2 x cp 2 x tp 1 x pp 1"
    with pytest.raises(ValueError, match="not a multiple of tp x pp x cp = 1 x 1 x 3"):
        mesh.check_sizes(4, 1, 1, 3)
