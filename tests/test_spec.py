"""The pure layer: meshes, placements and local-shape arithmetic (no processes)."""
import pytest
import torch

from dtorch.spec.placements import (DeviceMesh, Partial, Replicate, Shard, chunk_bounds,
                                    distinct_shard_ranks, format_placements, holds_partial_sum_value,
                                    local_region, narrow_to_box, nest_ranks)
from dtorch.errors import MeshError, PlacementError


def test_placements_print_short():
    assert format_placements([Shard(0), Replicate(), Partial()]) == "[S(0), R, P(sum)]"
    assert repr(Partial("max")) == "P(max)"
    with pytest.raises(PlacementError, match="legal ops"):
        Partial("mul")


@pytest.mark.parametrize("size,parts", [(10, 4), (3, 4), (8, 4), (0, 2), (1, 3), (7, 1)])
def test_chunk_bounds_match_torch_chunk(size, parts):
    chunks = torch.arange(size).chunk(parts) if size else ()
    for index in range(parts):
        start, length = chunk_bounds(size, parts, index)
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, start + length)) == expected


def test_mesh_geometry():
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
    assert mesh.shape == (2, 2) and mesh.coordinate_of(2) == (1, 0)
    assert mesh.group_along(1, 0) == (1, 3) and mesh.group_along(1, 1) == (0, 1)
    assert mesh.dim_index("tp") == 1 and mesh.size("dp") == 2
    assert mesh[1].ranks == (2, 3) and mesh[1].mesh_dim_names == ("tp",)
    assert [m.ranks for m in mesh.unbind("dp")] == [(0, 1), (2, 3)]
    assert [m.ranks for m in mesh.unbind("tp")] == [(0, 2), (1, 3)]
    with pytest.raises(MeshError):
        mesh.dim_index("pp")
    with pytest.raises(MeshError):
        DeviceMesh("cpu", [0, 0])


def test_nested_sharding_splits_the_outer_chunk():
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    placements = [Shard(0), Shard(0)]
    blocks = [local_region((5, 3), mesh, placements, mesh.coordinate_of(r)) for r in range(4)]
    # outer split 5 -> 3, 2; inner splits 3 -> 2, 1 and 2 -> 1, 1
    assert [(o[0], s[0]) for o, s in blocks] == [(0, 2), (2, 1), (3, 1), (4, 1)]


def test_nest_ranks_is_row_major():
    assert nest_ranks([4, 5, 6, 7], (2, 2)) == [[4, 5], [6, 7]]
    assert nest_ranks((0, 1, 2, 3), (2, 1, 2)) == [[[0, 1]], [[2, 3]]]
    assert nest_ranks((3, 1), (2,)) == [3, 1]
    assert DeviceMesh("cpu", nest_ranks(range(6), (3, 2))).shape == (3, 2)


def test_narrow_to_box_from_a_whole_tensor_or_a_held_block():
    whole = torch.arange(48).reshape(8, 6)
    assert torch.equal(narrow_to_box(whole, (2, 1), (3, 4)), whole[2:5, 1:5])
    held = whole[2:8, 0:6]        # a block that starts at global (2, 0)
    assert torch.equal(narrow_to_box(held, (4, 3), (2, 2), origin=(2, 0)), whole[4:6, 3:5])


def test_one_sender_per_distinct_shard():
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    assert distinct_shard_ranks(mesh, [Shard(0), Replicate()]) == (0, 2)
    assert distinct_shard_ranks(mesh, [Replicate(), Shard(1)]) == (0, 1)
    assert distinct_shard_ranks(mesh, [Replicate(), Replicate()]) == (0,)
    assert distinct_shard_ranks(mesh, [Shard(0), Shard(1)]) == (0, 1, 2, 3)


def test_a_whole_value_under_partial_sum_lives_on_coordinate_zero():
    placements = [Partial(), Shard(0)]
    assert holds_partial_sum_value(placements, (0, 1))
    assert not holds_partial_sum_value(placements, (1, 0))
    assert holds_partial_sum_value([Partial("max"), Replicate()], (1, 1))   # max: every rank keeps it


def test_init_device_mesh_starts_workers_through_the_installed_starter():
    import dtorch.spec.placements as spec
    asked, installed = [], spec._start_workers
    spec.set_worker_starter(lambda device_type, count: asked.append((device_type, count)) or [7, 5, 3, 1])
    try:
        mesh = spec.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    finally:
        spec.set_worker_starter(installed)
    assert asked == [("cpu", 4)] and mesh.shape == (2, 2) and mesh.ranks == (7, 5, 3, 1)
