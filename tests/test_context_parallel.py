"""Context-parallel attention against torch: ring attention (q, k, v sharded on their sequence;
key/value blocks pass around the ring) for causal and non-causal attention, GQA and uneven
sequence shards, beside other sharded mesh dims; Ulysses is the all-to-all form the Llama uses
(tests/test_llama.py). A failed input on a ring member never hangs its peers."""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import DependencyError, PlacementError, Replicate, Shard
from dtorch.spec.placements import init_device_mesh

from support import assert_same

pytestmark = pytest.mark.timeout(300)

SHAPES = {   # name -> (query length, key length, query heads, key/value heads)
    "square": (8, 8, 4, 4),
    "uneven": (7, 7, 4, 2),         # 7 positions over the ring: blocks of 4 and 3 (or 2, 2, 2, 1)
    "longer_keys": (5, 9, 2, 2),
    "tiny": (3, 3, 2, 1),           # fewer positions than ranks on (4,): an empty block travels too
}


@pytest.fixture(scope="module")
def cp_meshes(session):
    return {"cp2": (init_device_mesh("cpu", (2,), mesh_dim_names=["cp"]), [Shard(2)]),
            "cp4": (init_device_mesh("cpu", (4,), mesh_dim_names=["cp"]), [Shard(2)]),
            "dp2xcp2": (init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "cp"]), [Shard(0), Shard(2)]),
            "tp2xcp2": (init_device_mesh("cpu", (2, 2), mesh_dim_names=["tp", "cp"]), [Shard(1), Shard(2)])}


@pytest.mark.parametrize("layout", ["cp2", "cp4", "dp2xcp2", "tp2xcp2"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_matches_torch(layout, shape, causal, cp_meshes, strict):
    mesh, placements = cp_meshes[layout]
    length, keys, heads, kv_heads = SHAPES[shape]
    if layout == "tp2xcp2":   # heads sharded over tp: the sdpa rule wants as many kv heads (GQA: repeat them)
        kv_heads = heads
    g = torch.Generator().manual_seed(zlib.crc32(repr((layout, shape, causal)).encode()) % 1000)   # not hash(): salted
    q = torch.randn(2, heads, length, 8, generator=g)
    k, v = torch.randn(2, kv_heads, keys, 8, generator=g), torch.randn(2, kv_heads, keys, 6, generator=g)
    gqa = heads != kv_heads
    dq, dk, dv = (dtorch.tensor(t, device_mesh=mesh, placements=placements) for t in (q, k, v))
    out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal, enable_gqa=gqa)   # strict: no moves
    assert out.placements == tuple(placements)
    assert_same(out.to_torch(), F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa))


def test_ring_refuses_a_mask_and_half_sharded_inputs(cp_meshes, strict):
    mesh, placements = cp_meshes["cp2"]
    q = dtorch.randn(1, 2, 6, 4, device_mesh=mesh, placements=placements)
    mask = dtorch.ones(6, 6, dtype=torch.bool, device_mesh=mesh)
    with pytest.raises(PlacementError, match="ring attention takes no attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    replicated = dtorch.randn(1, 2, 6, 4, device_mesh=mesh, placements=[Replicate()])
    with pytest.raises(PlacementError, match="need queries and values sharded on theirs"):
        F.scaled_dot_product_attention(replicated, q, q)


def test_without_strict_mode_other_layouts_are_moved_to_a_legal_one(cp_meshes, automatic):
    mesh, placements = cp_meshes["cp2"]
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    dq = dtorch.tensor(q, device_mesh=mesh, placements=[Replicate()])
    dk, dv = (dtorch.tensor(t, device_mesh=mesh, placements=placements) for t in (k, v))
    out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
    assert_same(out.to_torch(), F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_a_failed_query_block_never_hangs_the_ring(cp_meshes):
    mesh = cp_meshes["cp4"][0]
    numerator = dtorch.tensor(torch.arange(8), device_mesh=mesh, placements=[Shard(0)])
    denominator = dtorch.tensor(torch.tensor([1, 1, 1, 1, 1, 1, 0, 1]), device_mesh=mesh, placements=[Shard(0)])
    broken = dtorch.div(numerator, denominator, rounding_mode="floor")    # fails on rank 3 only
    q = broken.float().reshape(1, 1, 8, 1)                                # S(2): rank 3's block is poisoned
    kv = dtorch.randn(1, 1, 8, 1, device_mesh=mesh, placements=[Shard(2)])
    out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
    with pytest.raises(DependencyError, match="div"):
        out.to_torch()
    healthy = F.scaled_dot_product_attention(kv, kv, kv, is_causal=True)   # the ring is intact afterwards
    full = kv.to_torch()
    assert_same(healthy.to_torch(), F.scaled_dot_product_attention(full, full, full, is_causal=True))
