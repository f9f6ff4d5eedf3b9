"""The paged decode attention kernel (app/engine/csrc/paged_decode.cpp) against gather + SDPA."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from app.engine.model.cpu_kernels import cpu_tag, paged_decode_op

BLOCK = 16


@pytest.fixture(scope="module")
def op():
    got = paged_decode_op()
    if platform.system() == "Linux":
        assert got is not None, "the paged decode kernel did not build here (see the warning above)"
    else:
        pytest.skip("the kernel is built on Linux only")
    return got


def reference(q, k_pool, v_pool, tables, lens, scale):
    """Each row's blocks gathered, masked past its length, one SDPA with grouped query heads."""
    out = []
    kvh = k_pool.shape[2]
    for i in range(q.shape[0]):
        n = int(lens[i])
        k = k_pool[tables[i]].reshape(-1, kvh, k_pool.shape[3])[:n].transpose(0, 1)
        v = v_pool[tables[i]].reshape(-1, kvh, v_pool.shape[3])[:n].transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_paged_decode_equals_gather_and_sdpa(op, heads, kv_heads, kv_dtype):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    num_blocks, dim = 64, 32
    lens = torch.tensor([1, 15, 16, 17, 100, 200, 7])
    max_blocks = -(-int(lens.max()) // BLOCK)
    k_pool = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    v_pool = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    # scattered, shared-free block ids; rows shorter than the longest are padded with block 0
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lens.tolist():
        need = -(-n // BLOCK)
        tables.append(ids[:need] + [0] * (max_blocks - need))
        ids = ids[need:]
    tables = torch.tensor(tables)
    q = torch.randn(len(lens), heads, dim, generator=g)
    k_pool, v_pool = k_pool.to(kv_dtype), v_pool.to(kv_dtype)
    got = op(q, k_pool, v_pool, tables, lens, 0.125)
    assert got.dtype == torch.float32
    # NOTE: bfloat16 K/V are read exactly (as float32), so the reference sees the same values
    want = reference(q, k_pool.float(), v_pool.float(), tables, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_paged_decode_refuses_what_would_read_outside_the_pool(op):
    q = torch.randn(1, 2, 8)
    pool = torch.randn(4, BLOCK, 2, 8)
    with pytest.raises(RuntimeError, match="block id outside the pool"):
        op(q, pool, pool, torch.tensor([[4]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="length outside the table"):
        op(q, pool, pool, torch.tensor([[0]]), torch.tensor([BLOCK + 1]), 1.0)
    with pytest.raises(RuntimeError, match="length outside the table"):
        op(q, pool, pool, torch.tensor([[0]]), torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="float32 queries, float32 or bfloat16 K/V only"):
        op(q.bfloat16(), pool.bfloat16(), pool.bfloat16(), torch.tensor([[0]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="float32 queries, float32 or bfloat16 K/V only"):
        op(q, pool, pool.bfloat16(), torch.tensor([[0]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="one table row per query"):
        op(q, pool, pool, torch.tensor([[0], [1]]), torch.tensor([3, 3]), 1.0)


def test_cpu_tag_names_the_instruction_set():
    tag = cpu_tag()
    assert tag.startswith(platform.machine()) and tag == cpu_tag() and len(tag.split("-")[-1]) == 10


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load(op):
    """torch's loader waits forever on its ``lock`` file; one left behind by a process killed
    mid-build is removed under foreserve's own flock, so the next load goes ahead."""
    from app.engine.model import cpu_kernels

    stale = cpu_kernels.build_directory() / "lock"
    stale.touch()
    assert cpu_kernels._build() is not None  # would spin on the stale lock before
    assert not stale.exists()
