"""DTorch's spellings and torch's keyword forms, each against plain torch (docs/guide/migrating.md
lists what still differs): dtorch.Tensor, dtorch.Generator, DTensor.device / .data /
to_torch_async, redistribute_by_dict's keywords, placements equal to a list, DeviceMesh.unbind(dims=),
x.to(mesh), init_device_mesh with an int shape, the one-device-mesh rule, plus the ops whose
layout handling is easiest to get wrong: cat of uneven shards along the cat dim, repeat_interleave,
where with Python scalars (the ops whose shape depends on the values: tests/test_data_dependent.py)."""
import asyncio

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.spec.placements import DeviceMesh, init_device_mesh
from dtorch.errors import MeshError

pytestmark = pytest.mark.timeout(120)


def _up(value, mesh, placements):
    return dtorch.tensor(value, device_mesh=mesh, placements=placements)


# --- torch's keyword spellings ------------------------------------------------------------------
def test_torch_keyword_spellings_of_shape_ops(mesh22):
    a = torch.randn(4, 6)
    x = _up(a, mesh22, [Shard(0), Replicate()])
    pairs = [
        (dtorch.reshape(x, shape=(6, 4)), torch.reshape(a, shape=(6, 4))),
        (torch.reshape(x, shape=(2, 12)), torch.reshape(a, shape=(2, 12))),
        (x.reshape(shape=(8, 3)), a.reshape(shape=(8, 3))), (x.view(size=(4, 2, 3)), a.view(size=(4, 2, 3))),
        (x.view(-1), a.view(-1)), (x.reshape((2, -1)), a.reshape((2, -1))),
        (x.split(split_size=4, dim=1)[1], a.split(split_size=4, dim=1)[1]),
        (torch.split(x, split_size_or_sections=[2, 4], dim=1)[1], torch.split(a, [2, 4], dim=1)[1]),
        (x.repeat(repeats=(1, 2)), a.repeat(repeats=(1, 2))), (x.permute(dims=(1, 0)), a.permute(dims=(1, 0))),
        (x.sum(dim=1, keepdim=True), a.sum(dim=1, keepdim=True)), (x.round(decimals=1), a.round(decimals=1)),
    ]
    for got, want in pairs:
        assert torch.equal(got.to_torch(), want)
    with pytest.raises(TypeError, match="shape="):
        x.reshape((6, 4), shape=(6, 4))
    with pytest.raises(TypeError, match="size="):
        x.view(shape=(6, 4))


# --- new ops beyond the sweep's samples ----------------------------------------------------------
def test_where_takes_python_scalars_on_either_side(mesh4):
    a = torch.randn(7, 5)
    x = _up(a, mesh4, [Shard(0)])
    c = x > 0
    assert torch.equal(torch.where(c, x, 0.0).to_torch(), torch.where(a > 0, a, 0.0))
    assert torch.equal(dtorch.where(c, 1.0, x).to_torch(), torch.where(a > 0, 1.0, a))
    assert torch.equal(dtorch.where(c, 1.0, -1.0).to_torch(), torch.where(a > 0, 1.0, -1.0))


def test_repeat_interleave_keeps_a_shard_on_another_dim(mesh4, mesh22):
    a = torch.randn(7, 5)
    x = _up(a, mesh4, [Shard(1)])
    y = x.repeat_interleave(3, dim=0)
    assert y.placements == [Shard(1)]
    assert torch.equal(y.to_torch(), a.repeat_interleave(3, dim=0))
    z = _up(a, mesh22, [Shard(0), Shard(1)]).repeat_interleave(2, dim=1)
    assert torch.equal(z.to_torch(), a.repeat_interleave(2, dim=1))
    assert torch.equal(torch.repeat_interleave(x, 2).to_torch(), torch.repeat_interleave(a, 2))


@pytest.mark.usefixtures("automatic")
@pytest.mark.parametrize("sizes", [(5, 3), (1, 6), (8, 4), (0, 3)])
def test_cat_of_uneven_shards_along_the_cat_dim_matches_torch(mesh4, mesh22, sizes):
    first, second = torch.randn(sizes[0], 3), torch.randn(sizes[1], 3)
    for mesh, placements in [(mesh4, [Shard(0)]), (mesh22, [Shard(0), Shard(0)]), (mesh22, [Replicate(), Shard(0)])]:
        x, y = _up(first, mesh, placements), _up(second, mesh, placements)
        assert torch.equal(dtorch.cat([x, y]).to_torch(), torch.cat([first, second]))
        assert torch.equal(torch.cat([y, x, y], dim=0).to_torch(), torch.cat([second, first, second]))


@pytest.mark.usefixtures("strict")
def test_cat_along_a_sharded_dim_in_strict_mode_names_the_fix(mesh4):
    x = _up(torch.randn(5, 3), mesh4, [Shard(0)])
    with pytest.raises(dtorch.PlacementError, match="cat along sharded dim 0"):
        dtorch.cat([x, x])


# --- DTorch's spellings --------------------------------------------------------------------------
def test_device_data_and_to_torch_async(mesh4):
    a = torch.randn(6, 2)
    x = _up(a, mesh4, [Shard(0)])
    assert x.device == torch.device("cpu")
    y = _up(a, mesh4, [Shard(0)])
    y.data.mul_(3)                       # torch's .data: an alias without autograd history
    torch.testing.assert_close(y.to_torch(), 3 * a)
    future = (x * 2).to_torch_async()
    assert torch.equal(future.result(timeout=60), a * 2)
    assert future.is_ready() and torch.equal(future.get(), a * 2)   # DTorch's TensorFuture names

    async def read():
        return await x.to_torch_async()
    assert torch.equal(asyncio.run(read()), a)


def test_placements_equal_a_list_and_a_tuple(mesh22):
    x = _up(torch.randn(4, 4), mesh22, [Shard(0), Partial()])
    assert x.placements == [Shard(0), Partial()] and x.placements == (Shard(0), Partial())
    assert x.placements != [Shard(0), Replicate()] and not x.placements == [Shard(0)]
    assert hash(x.placements) == hash((Shard(0), Partial())) and isinstance(x.placements, tuple)


def test_init_device_mesh_takes_an_int_shape(session):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=["dp"])
    assert mesh.shape == (4,) and mesh == init_device_mesh("cpu", (4,), mesh_dim_names=["dp"])


def test_unbind_takes_dtorch_dims_keyword():
    mesh = DeviceMesh("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], mesh_dim_names=["pp", "dp", "tp"])
    assert [m.ranks for m in mesh.unbind(dims=["pp"])] == [m.ranks for m in mesh.unbind("pp")] == [(0, 1, 2, 3),
                                                                                                   (4, 5, 6, 7)]
    stages = mesh.unbind(dims=["pp", "tp"])
    assert [m.ranks for m in stages] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert all(m.mesh_dim_names == ("dp",) and m.shape == (2,) for m in stages)
    assert [m.ranks for m in mesh.unbind(dims=[0, 1, 2])][:2] == [(0,), (1,)]
    with pytest.raises(MeshError):
        mesh.unbind(dims=["ep"])


def test_redistribute_by_dict_keywords(mesh22):
    a = torch.randn(4, 6)
    x = _up(a, mesh22, [Shard(0), Shard(1)])
    kept = x.redistribute_by_dict(placements_dict={"tp": Replicate()}, default_placement_mode="keep")
    assert kept.placements == [Shard(0), Replicate()]
    replicated = x.redistribute_by_dict(mesh22, placements_dict={"tp": Shard(0)}, default_placement_mode="replicate")
    assert replicated.placements == [Replicate(), Shard(0)]
    assert x.redistribute_by_dict({1: Replicate()}).placements == [Shard(0), Replicate()]   # dtorch's own order
    full = x.redistribute_by_dict(placements_dict={"dp": Replicate(), "tp": Shard(1)},
                                  default_placement_mode="raise_error")
    for y in (kept, replicated, full):
        assert torch.equal(y.to_torch(), a)
    with pytest.raises(MeshError, match="raise_error"):
        x.redistribute_by_dict(placements_dict={"dp": Replicate()}, default_placement_mode="raise_error")
    with pytest.raises(ValueError, match="default_placement_mode"):
        x.redistribute_by_dict(placements_dict={}, default_placement_mode="drop")


def test_to_moves_between_meshes(mesh4, mesh22):
    a = torch.randn(9, 4)
    x = _up(a, mesh4, [Shard(0)])
    stage = mesh22.unbind("dp")[1]                 # a 1-D mesh: the placements carry over
    moved = x.to(stage)
    assert moved.device_mesh == stage and moved.placements == [Shard(0)]
    reshaped = x.to(mesh22)                        # two mesh dims: Replicate unless given
    assert reshaped.placements == [Replicate(), Replicate()]
    given = x.to(mesh22, placements=[Shard(1), Shard(0)])
    assert given.placements == [Shard(1), Shard(0)] and x.to(device_mesh=stage).device_mesh == stage
    for y in (moved, reshaped, given):
        assert torch.equal(y.to_torch(), a)


# --- dtorch.Tensor and the one-device mesh ---------------------------------------------------------
def test_tensor_constructor_and_isinstance(mesh4):
    a = torch.randn(8, 3)
    x = dtorch.Tensor(a, device_mesh=mesh4, placements=[Shard(0)])
    assert type(x) is dtorch.DTensor and isinstance(x, dtorch.Tensor) and issubclass(dtorch.DTensor, dtorch.Tensor)
    assert not isinstance(a, dtorch.Tensor) and x.placements == [Shard(0)]
    assert torch.equal(x.to_torch(), a)
    lone = dtorch.Tensor([1.0, 2.0, 3.0])
    assert lone.device_mesh.size() == 1 and lone.device_mesh.device_type == "cpu"
    assert torch.equal(lone.to_torch(), torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(dtorch.DTorchError, match="not both"):
        dtorch.Tensor(a, device="cpu", device_mesh=mesh4)



def test_an_upload_is_a_snapshot_of_its_source(mesh22):
    """dtorch.tensor returns before its frames are sent (the loop thread sends them), so a source
    changed in place right after the call (a reused batch buffer) must not change the upload:
    torch tensors (whole, a view, cast on the way), numpy arrays, every placement. Until
    2026-12-04 the frames were views of the caller's memory and every one of these read 1s."""
    import numpy
    for placements in ([Replicate(), Replicate()], [Shard(0), Shard(1)], [Shard(1), Replicate()]):
        buffer, array = torch.zeros(6, 4), numpy.zeros((6, 4), dtype=numpy.float32)
        uploads = [dtorch.tensor(buffer, device_mesh=mesh22, placements=placements),
                   dtorch.tensor(buffer[:, 1:3], device_mesh=mesh22, placements=placements),
                   dtorch.tensor(buffer, dtype=torch.float64, device_mesh=mesh22, placements=placements),
                   dtorch.distribute_tensor(buffer, mesh22, placements),
                   dtorch.tensor(array, device_mesh=mesh22, placements=placements)]
        buffer.fill_(1.0)
        array.fill(1.0)
        for upload in uploads:
            assert not upload.to_torch().any(), (placements, upload)


def test_distribute_tensor_is_torchs_spelling_of_an_upload(mesh22):
    """torch.distributed.tensor.distribute_tensor's positional signature: the shards land on the
    workers (uneven ones too), requires_grad carries over to a leaf, as torch's does."""
    a = torch.randn(5, 3, requires_grad=True)
    x = dtorch.distribute_tensor(a, mesh22, [Shard(0), Shard(1)])
    assert x.placements == [Shard(0), Shard(1)] and x.is_leaf and x.requires_grad
    assert torch.equal(x.to_torch(), a.detach())
    (x * 2).sum().backward()
    assert torch.equal(x.grad.to_torch(), torch.full((5, 3), 2.0))
    plain = dtorch.distribute_tensor(torch.ones(4), mesh22, src_data_rank=None)
    assert plain.placements == [Replicate(), Replicate()] and not plain.requires_grad
    with pytest.raises(dtorch.DTorchError, match="already distributed.*redistribute"):
        dtorch.distribute_tensor(x, mesh22, [Replicate(), Replicate()])
    with pytest.raises(TypeError, match="takes a torch.Tensor"):
        dtorch.distribute_tensor([1.0, 2.0], mesh22)

@pytest.mark.usefixtures("automatic")
def test_a_one_device_tensor_joins_the_other_mesh(mesh4, mesh22):
    a, bias = torch.randn(8, 3), torch.randn(3)
    x = _up(a, mesh22, [Shard(0), Shard(1)])
    b = dtorch.Tensor(bias)                            # no mesh: one device
    before = dtorch.stats()["redistributes_inserted"]
    for got, want in [(x + b, a + bias), (b * x, bias * a), (dtorch.where(x > 0, b, x), torch.where(a > 0, bias, a))]:
        assert got.device_mesh == mesh22
        torch.testing.assert_close(got.to_torch(), want)
    assert dtorch.stats()["redistributes_inserted"] > before
    y = _up(a, mesh4, [Shard(0)])
    with pytest.raises(MeshError, match="different meshes"):   # two larger meshes: no rule picks one
        x + y


@pytest.mark.usefixtures("strict")
def test_strict_mode_refuses_the_one_device_join(mesh22):
    x = _up(torch.randn(8, 3), mesh22, [Shard(0), Replicate()])
    with pytest.raises(MeshError, match="different meshes"):
        x + dtorch.Tensor(torch.randn(3))


def test_a_local_torch_tensor_beside_dtensors_is_a_replicated_constant(mesh22):
    """torch code makes small tensors inside forward (nanoGPT's torch.arange positions, a 0-d
    scale): beside DTensors one is uploaded Replicate on their mesh, as a Python scalar would be
    sent, counted in stats(); values and gradients equal torch's. Strict mode refuses it at the
    line, saying how to upload it."""
    table, a = torch.randn(10, 4), torch.randn(6, 4)
    x = dtorch.tensor(a, device_mesh=mesh22, placements=[Shard(0), Replicate()], requires_grad=True)
    weight = dtorch.tensor(table, device_mesh=mesh22, placements=[Replicate(), Shard(1)], requires_grad=True)
    before = dtorch.stats()["local_tensors_uploaded"]
    positions = torch.arange(0, 6, dtype=torch.long)
    out = x + torch.nn.functional.embedding(positions, weight) * torch.tensor(0.5)
    out = torch.cat([out, torch.ones(1, 4)])
    assert dtorch.stats()["local_tensors_uploaded"] - before == 3
    reference_x, reference_table = a.clone().requires_grad_(), table.clone().requires_grad_()
    expected = torch.cat([reference_x + torch.nn.functional.embedding(positions, reference_table) * 0.5,
                          torch.ones(1, 4)])
    torch.testing.assert_close(out.to_torch(), expected.detach())
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(weight.grad.to_torch(), reference_table.grad)
    torch.testing.assert_close(x.grad.to_torch(), reference_x.grad)
    previous = dtorch.is_strict()
    dtorch.set_strict(True)
    try:
        with pytest.raises(dtorch.LocalTensorError,
                           match=r"add: a local torch.Tensor .*test_api_compat.py.*distribute_tensor"):
            x + torch.ones(4)
    finally:
        dtorch.set_strict(previous)


# --- dtorch.Generator ----------------------------------------------------------------------------
def test_generator_streams_are_layout_invariant_and_apart_from_the_global_one(mesh4, mesh22):
    results = []
    for mesh, placements in [(mesh4, [Shard(0)]), (mesh4, [Replicate()]), (mesh22, [Shard(1), Shard(0)])]:
        g = dtorch.Generator().manual_seed(11)
        results.append([dtorch.randn(9, 5, generator=g, device_mesh=mesh, placements=placements).to_torch(),
                        dtorch.rand(9, 5, generator=g, device_mesh=mesh, placements=placements).to_torch(),
                        dtorch.randint(0, 7, (9, 5), generator=g, device_mesh=mesh, placements=placements).to_torch()])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    first, second = results[0][0], results[0][1]
    assert not torch.equal(first, second)
    # the global stream neither moves nor matters
    dtorch.manual_seed(3)
    plain = dtorch.randn(9, 5, device_mesh=mesh4).to_torch()
    dtorch.manual_seed(3)
    g = dtorch.Generator().manual_seed(11)
    from_generator = dtorch.randn(9, 5, generator=g, device_mesh=mesh4).to_torch()
    assert torch.equal(dtorch.randn(9, 5, device_mesh=mesh4).to_torch(), plain)
    assert torch.equal(from_generator, first)
    like = dtorch.randn_like(dtorch.zeros(9, 5, device_mesh=mesh4), generator=dtorch.Generator().manual_seed(11))
    assert torch.equal(like.to_torch(), first)
    with pytest.raises(TypeError, match="dtorch.Generator"):
        dtorch.randn(3, generator=torch.Generator(), device_mesh=mesh4)


def test_a_scalar_formats_as_its_value_and_pickling_says_how_to_save(mesh4):
    """Training loops print f"{loss:.4f}" (torch formats a 0-d tensor as its value); torch.save
    of a state_dict of DTensors says what to use instead of failing on a lock deep in pickle."""
    import io
    import pickle
    a = torch.arange(32.0).reshape(8, 4) / 4   # sums exactly in any order
    x = _up(a, mesh4, [Shard(0)])
    assert f"{x.sum():.3f}" == "124.000" and f"{x.sum()}" == "124.0"
    with pytest.raises(TypeError, match="unsupported format"):
        f"{x:.3f}"
    for save in (lambda: pickle.dumps(x), lambda: torch.save({"w": x}, io.BytesIO())):
        with pytest.raises(TypeError, match="dtorch.checkpoint.save"):
            save()
