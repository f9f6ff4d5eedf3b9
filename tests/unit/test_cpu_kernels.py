"""The paged decode attention kernel (app/engine/csrc/paged_decode.cpp) against gather + SDPA."""

from __future__ import annotations

import os
import platform

import pytest
import torch
import torch.nn.functional as F

from app.engine.model.cpu_kernels import bf16_linear_op, cpu_tag, paged_decode_op

BLOCK = 16


@pytest.fixture(scope="module")
def op():
    got = paged_decode_op()
    if platform.system() == "Linux":
        assert got is not None, "the paged decode kernel did not build here (see the warning above)"
    else:
        pytest.skip("the kernel is built on Linux only")
    return got


def reference(q, k_pool, v_pool, tables, lens, scale, starts=None):
    """Each row's blocks gathered, cut to [start, length), one SDPA with grouped query heads."""
    out = []
    kvh = k_pool.shape[2]
    for i in range(q.shape[0]):
        n, a = int(lens[i]), 0 if starts is None else int(starts[i])
        k = k_pool[tables[i]].reshape(-1, kvh, k_pool.shape[3])[a:n].transpose(0, 1)
        v = v_pool[tables[i]].reshape(-1, kvh, v_pool.shape[3])[a:n].transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
# NOTE: heads of 64 and 128 elements with 1-4 and 1-2 query heads per KV head take the AVX-512 path
# where there is one (16 tokens at a time); the rest, and other CPUs, the AVX2 one
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 32), (4, 4, 32), (8, 1, 32), (9, 3, 64), (4, 4, 64),
                                                (8, 2, 64), (8, 1, 64), (4, 2, 128), (4, 4, 128), (9, 3, 128)])
# NOTE: with 2 threads, 7 rows run a task each; 1 and 2 rows are cut into token ranges (up to 4 per
# row), one of them empty for the row of 1 token, and merged.
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 100, 200, 7], [333], [1, 400], [130, 64]])
def test_paged_decode_equals_gather_and_sdpa(op, heads, kv_heads, dim, kv_dtype, lens):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_paged_decode(op, heads, kv_heads, kv_dtype, torch.tensor(lens), dim=dim)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_paged_decode_with_a_sliding_window_reads_only_its_last_positions(op, window):
    """``starts``: each row attends to positions [start, length) only, the window of a sliding-window
    layer, which may begin inside a block; rows shorter than the window read from 0."""
    lens = torch.tensor([1, 15, 16, 17, 100, 200, 7])
    for heads, kv_heads, dim in ((9, 3, 64), (8, 2, 32), (4, 1, 256)):
        _check_paged_decode(op, heads, kv_heads, torch.bfloat16, lens, dim=dim, starts=(lens - window).clamp(min=0))


def _check_paged_decode(op, heads, kv_heads, kv_dtype, lens, scale=0.125, dim=32, starts=None):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    num_blocks = 64
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
    got = op(q, k_pool, v_pool, tables, lens, scale, starts)
    assert got.dtype == torch.float32
    # NOTE: bfloat16 K/V are read exactly (as float32), so the reference sees the same values
    want = reference(q, k_pool.float(), v_pool.float(), tables, lens, scale, starts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_paged_decode_with_scores_hundreds_apart(op):
    """Scores far below the largest (exp of -100s: underflow, where the kernel's vectorised exp clamps)
    weigh nothing and make no NaN; the largest few decide."""
    _check_paged_decode(op, 9, 3, torch.bfloat16, torch.tensor([333, 40]), scale=20.0)
    _check_paged_decode(op, 9, 3, torch.bfloat16, torch.tensor([333, 40]), scale=20.0, dim=64)


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
    with pytest.raises(RuntimeError, match="start outside"):
        op(q, pool, pool, torch.tensor([[0]]), torch.tensor([3]), 1.0, torch.tensor([3]))
    with pytest.raises(RuntimeError, match="starts must be"):
        op(q, pool, pool, torch.tensor([[0]]), torch.tensor([3]), 1.0, torch.tensor([0, 0]))


def test_cpu_tag_names_the_instruction_set():
    tag = cpu_tag()
    assert tag.startswith(platform.machine()) and tag == cpu_tag() and len(tag.split("-")[-1]) == 10


def test_two_checkouts_build_in_folders_of_their_own(monkeypatch, tmp_path):
    """A build folder shared by two checkouts (a clone beside the working tree) would be rebuilt,
    minutes on 2 cores, each time the other one had built last."""
    from app.engine.model import cpu_kernels

    here = cpu_tag()
    monkeypatch.setattr(cpu_kernels, "SOURCES", [tmp_path / "csrc" / s.name for s in cpu_kernels.SOURCES])
    assert cpu_tag() != here and cpu_tag().startswith(platform.machine())


def test_the_build_runs_this_environments_ninja_first(monkeypatch, tmp_path):
    """torch's loader runs the first ``ninja`` on PATH; two versions read each other's build log as
    foreign and rebuild everything, so the build puts the environment's own (pinned) one first,
    and leaves PATH as it was after."""
    import shutil
    import sys

    from app.engine.model import cpu_kernels

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ninja").write_text("#!/bin/sh\necho 1.13.2\n")
    (fake / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake / "python"))
    before = os.environ.get("PATH", "")
    with cpu_kernels._pinned_ninja():
        assert shutil.which("ninja") == str(fake / "ninja")
    assert os.environ.get("PATH", "") == before
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # no ninja beside it: PATH as it is
    with cpu_kernels._pinned_ninja():
        assert os.environ.get("PATH", "") == before


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load(op):
    """torch's loader waits forever on its ``lock`` file; one left behind by a process killed
    mid-build is removed under foreserve's own flock, so the next load goes ahead."""
    from app.engine.model import cpu_kernels

    stale = cpu_kernels.build_directory() / "lock"
    stale.touch()
    assert cpu_kernels._build() is not None  # would spin on the stale lock before
    assert not stale.exists()


@pytest.mark.parametrize("m,k,n", [(1, 576, 576), (2, 1536, 576), (3, 7, 9), (4, 576, 962), (5, 64, 7), (6, 33, 5),
                                   (7, 1536, 10), (13, 96, 48), (16, 96, 13), (33, 64, 40)])
def test_bf16_linear_equals_float64_product(op, m, k, n):
    """x [m, k] float32 times bfloat16 w [n, k]: the product of the exact values, to float32's
    rounding, for sizes on and off the kernels' tiles (dot products: 4 outputs by 1-2 rows, 2 outputs
    by 3-4 rows, 16 elements; packed panels: 16 outputs by 6 rows with AVX2, 2 x 16 outputs by 8
    rows with AVX512-BF16, pairs of elements) and the outputs and rows left over. Built with
    AVX512-BF16, the packed panels multiply x rounded to bfloat16 (``packed_rows_rounded``)."""
    lin = bf16_linear_op()
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    want = x.double() @ w.double().t()
    torch.testing.assert_close(lin(x, w, None).double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lin(x, w, b).double(), want + b.double(), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="float32 x and bfloat16 w"):
        lin(x, w.float(), None)
    if k % 2 == 0:  # the packed panels (pairs of k): more than one row runs them
        from app.engine.model.cpu_kernels import bf16_pack_op, packed_rows_rounded

        packed = bf16_pack_op()(w)
        if m > 1 and packed_rows_rounded():
            want = x.bfloat16().double() @ w.double().t()
        torch.testing.assert_close(lin(x, w, None, packed).double(), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(lin(x, w, b, packed).double(), want + b.double(), rtol=1e-5, atol=1e-4)
    else:
        from app.engine.model.cpu_kernels import bf16_pack_op

        with pytest.raises(RuntimeError, match="k even"):
            bf16_pack_op()(w)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_rope_store_equals_torch_rope_and_index_copy(op, kv_dtype):
    """RoPE on the fused projection's q and k, and the K/V store at each token's slot: the same
    values as the runner's torch ops (rotate-half, cast, index_copy_), bit for bit."""
    from app.engine.model.cpu_kernels import rope_store_op
    from app.engine.model.rope import apply_rope as _rope

    rope_store = rope_store_op()
    g = torch.Generator().manual_seed(7)
    T, heads, kv_heads, dim = 5, 9, 3, 64
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.randn(T, dim // 2, generator=g)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    slots = torch.tensor([3, 17, 18, 40, 0])
    k_pool = torch.zeros(4, BLOCK, kv_heads, dim, dtype=kv_dtype)
    v_pool = torch.zeros_like(k_pool)
    qk = rope_store(qkv, cos, sin, slots, k_pool, v_pool, heads, kv_heads)
    nq = heads + kv_heads
    want = _rope(qkv[:, : nq * dim].view(T, nq, dim), cos[:, None], sin[:, None])
    assert torch.equal(qk, want)
    k_want, v_want = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    k_want.view(-1, kv_heads, dim).index_copy_(0, slots, want[:, heads:].to(kv_dtype))
    v_want.view(-1, kv_heads, dim).index_copy_(0, slots, qkv[:, nq * dim:].view(T, kv_heads, dim).to(kv_dtype))
    assert torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want)
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        rope_store(qkv, cos, sin, torch.tensor([0, 1, 2, 3, 64]), k_pool, v_pool, heads, kv_heads)


def test_add_rms_norm_adds_in_place_and_normalizes(op):
    """h += delta in place, then the RMSNorm of HF's Llama (float32): torch's values to rounding."""
    from app.engine.model.cpu_kernels import add_rms_norm_op

    add_rms_norm = add_rms_norm_op()
    g = torch.Generator().manual_seed(3)
    h, delta, w = torch.randn(4, 576, generator=g), torch.randn(4, 576, generator=g), torch.randn(576, generator=g)
    want_h = h + delta
    want = w * (want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(h, want_h)  # updated in place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(add_rms_norm(h, None, w, 1e-5), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(h, want_h)  # no delta: h unchanged


def test_silu_mul_equals_torch(op):
    from app.engine.model.cpu_kernels import silu_mul_op

    silu_mul = silu_mul_op()
    gate_up = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(4)) * 6
    gate, up = gate_up.chunk(2, dim=1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="silu_mul"):
        silu_mul(gate_up[:, 1:])


@pytest.mark.parametrize("packed", [False, True])  # the weights' packed panels, which 3 rows run on
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("first", [True, False])  # the first layer has no delta to add
def test_decode_layer_equals_its_kernels_one_by_one(op, rows, first, packed):
    """The layer in one call runs the kernels the runner's Python forward calls, in that order: the
    same residual stream, K/V pool and output, bit for bit."""
    from app.engine.model import cpu_kernels as k

    g = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim, hidden, inner = 9, 3, 64, 96, 160

    def weight(n, m):
        return (torch.randn(n, m, generator=g) / m**0.5).to(torch.bfloat16)

    norms = [1 + 0.1 * torch.randn(hidden, generator=g) for _ in range(2)]
    ws = [weight((heads + 2 * kv_heads) * dim, hidden), weight(hidden, heads * dim), weight(2 * inner, hidden),
          weight(hidden, inner)]
    h = torch.randn(rows, hidden, generator=g)
    delta = None if first else torch.randn(rows, hidden, generator=g)
    angles = torch.randn(rows, dim // 2, generator=g)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    lens = torch.tensor([40, 17, 5][:rows])
    tables = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 0, 0]][:rows])
    slots = torch.stack([tables[i, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lens.tolist())])
    pools = [torch.randn(6, BLOCK, kv_heads, dim, generator=g).to(torch.bfloat16) for _ in range(2)]
    args = (cos, sin, slots)

    ps = [k.bf16_pack_op()(w) for w in ws] if packed else [None] * 4
    lin = k.bf16_linear_op()
    h1, k1, v1 = h.clone(), pools[0].clone(), pools[1].clone()
    x = k.add_rms_norm_op()(h1, delta, norms[0], 1e-5)
    qk = k.rope_store_op()(lin(x, ws[0], None, ps[0]), *args, k1, v1, heads, kv_heads)
    o = op(qk[:, :heads].contiguous(), k1, v1, tables, lens, 0.125)
    x = k.add_rms_norm_op()(h1, lin(o.view(rows, -1), ws[1], None, ps[1]), norms[1], 1e-5)
    want = lin(k.silu_mul_op()(lin(x, ws[2], None, ps[2])), ws[3], None, ps[3])

    h2, k2, v2 = h.clone(), pools[0].clone(), pools[1].clone()
    got = k.decode_layer_op()(h2, delta, norms[0], ws[0], ws[1], norms[1], ws[2], ws[3], 1e-5, *args, k2, v2,
                              tables, lens, heads, kv_heads, 0.125, ps if packed else [])
    assert torch.equal(got, want) and torch.equal(h2, h1) and torch.equal(k2, k1) and torch.equal(v2, v1)
    assert not torch.equal(h2, h)  # the residual stream was updated in place


def test_linear_microbench_times_every_path_it_names(op, capsys):
    """``python -m loadtests.bench.linear_microbench``: a line per row count, the packed column blank
    at one row (the dot products run it), oneDNN's bfloat16 column only on a CPU with native bfloat16,
    and a clear error for a bad row count."""
    from app.engine.model.cpu_linear import native_bf16
    from loadtests.bench.linear_microbench import main

    main(["--rows", "1", "7", "--reps", "1", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    native = int(native_bf16())
    assert lines[0].split()[0] == "rows" and [line.split()[0] for line in lines[1:]] == ["1", "7"]
    assert len(lines[1].split()) == 3 + native and len(lines[2].split()) == 5 + native  # one row: no packed figures
    with pytest.raises(SystemExit):
        main(["--rows", "0"])


def test_attention_microbench_prints_a_line_per_batch(op, capsys):
    """``python -m loadtests.bench.attention_microbench``: the hot and cold times and the K/V bytes
    read per second for each batch, and a clear error for heads that KV heads do not divide."""
    from loadtests.bench.attention_microbench import main

    main(["--batch", "1", "3", "--context-tokens", "40", "--layers", "2", "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "batch" and [line.split()[0] for line in lines[1:]] == ["1", "3"]
    assert all(len(line.split()) == 4 and float(line.split()[3]) > 0 for line in lines[1:])
    with pytest.raises(SystemExit):
        main(["--heads", "9", "--kv-heads", "2"])
