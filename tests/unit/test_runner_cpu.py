"""The runner's CPU pieces that need no model: decode groups, the linear fast paths, prepacking,
and the short-lived build thread (the model-loading runner tests are tests/model/test_runner.py)."""

from __future__ import annotations

import pytest
import torch


def test_decode_groups_cover_sorted_rows_in_equal_slices():
    from app.engine.model.step_inputs import DECODE_GROUP_ROWS, MAX_DECODE_GROUPS, decode_groups

    assert decode_groups([]) == []
    assert decode_groups(list(range(5))) == [(0, 5)]  # too few rows to split
    assert decode_groups(list(range(2 * DECODE_GROUP_ROWS))) == [(0, DECODE_GROUP_ROWS), (DECODE_GROUP_ROWS, 2 * DECODE_GROUP_ROWS)]
    groups = decode_groups(list(range(101)))
    assert len(groups) == MAX_DECODE_GROUPS and groups[0][0] == 0 and groups[-1][1] == 101
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    assert max(b - a for a, b in groups) - min(b - a for a, b in groups) <= 1


def test_a_small_paged_step_runs_its_prompt_tokens_as_decode_rows():
    """Within ``paged_rows`` tokens a step's prompt chunks become decode rows, each token attending to
    its sequence's positions up to its own; past it, or without the paged kernel, they stay prefills."""
    from app.engine.model.step_inputs import build_step
    from app.engine.outputs import ScheduledChunk
    from app.engine.model.rope import Rope, RopeSpec
    from app.engine.request import SamplingParams

    ropes = {"default": Rope(RopeSpec(10000.0, 4))}
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    chunks = [ScheduledChunk("d", [7], 20, [3, 4], True, greedy, 0),  # a decode row at position 20
              ScheduledChunk("p", [1, 2, 3], 16, [5, 6], True, greedy, 0),  # a prompt's last chunk, 16-18
              ScheduledChunk("q", [4, 5], 0, [9], False, greedy, 0)]  # a prompt's first chunk, 0-1
    step = build_step(chunks, 16, ropes, torch.float32, paged=True, paged_rows=6)
    assert step.num_decode == 6 and step.prefills == [] and step.decode == []
    assert step.input_ids.tolist() == [4, 5, 1, 2, 3, 7]  # by first position: q, p, d
    assert step.decode_lens.tolist() == [1, 2, 17, 18, 19, 21]
    assert step.decode_tables.tolist() == [[9, 0], [9, 0], [5, 6], [5, 6], [5, 6], [3, 4]]
    assert step.slots.tolist() == [9 * 16, 9 * 16 + 1, 6 * 16, 6 * 16 + 1, 6 * 16 + 2, 4 * 16 + 4]
    assert step.sample_rows.tolist() == [4, 5] and [c.request_id for c in step.sample_chunks] == ["p", "d"]
    for unfolded in (build_step(chunks, 16, ropes, torch.float32, paged=True, paged_rows=5),
                     build_step(chunks, 16, ropes, torch.float32, paged=False, paged_rows=6)):
        assert unfolded.num_decode == 1 and [(p.start, p.end) for p in unfolded.prefills] == [(1, 4), (4, 6)]
        assert unfolded.sample_rows.tolist() == [0, 3]
    assert build_step(chunks, 16, ropes, torch.float32, paged=True).decode_lens.tolist() == [21]


@pytest.mark.parametrize("rows", [1, 2, 7, 128, 129, 300])  # either side of SKINNY_ROWS
@pytest.mark.parametrize("bias", [False, True])
def test_linear_fast_path_equals_module(rows, bias):
    from app.engine.model.cpu_linear import linear

    torch.manual_seed(rows)
    module = torch.nn.Linear(96, 320, bias=bias)
    x = torch.randn(rows, 96)
    out = linear(module, x)
    assert out.shape == (rows, 320) and out.is_contiguous()
    torch.testing.assert_close(out, module(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 9, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_equals_module(rows, bias):
    from app.engine.model.cpu_linear import linear, prepack

    torch.manual_seed(rows)
    module = torch.nn.Linear(96, 320, bias=bias)
    packed = prepack(module)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    assert packed is not None
    x = torch.randn(rows, 96)
    out = linear(module, x, packed)
    assert out.shape == (rows, 320) and out.is_contiguous()
    torch.testing.assert_close(out, module(x), rtol=1e-5, atol=1e-5)


def test_prepack_leaves_what_it_cannot_pack():
    from app.engine.model.cpu_linear import prepack

    class Scaled(torch.nn.Linear):  # a TP layer's subclass keeps its own forward
        pass

    assert prepack(Scaled(8, 4)) is None
    from app.engine.model.cpu_linear import native_bf16

    if not native_bf16():  # bfloat16 weights are prepacked only where oneDNN has bfloat16 kernels
        assert prepack(torch.nn.Linear(8, 4).to(torch.bfloat16)) is None
    assert prepack(torch.nn.LayerNorm(8)) is None


def test_linear_leaves_other_modules_to_their_forward():
    from app.engine.model.cpu_linear import linear

    class Scaled(torch.nn.Linear):  # a subclass (e.g. a TP layer) keeps its own forward
        def forward(self, x):
            return 2 * super().forward(x)

    module = Scaled(8, 4)
    x = torch.randn(3, 8)
    torch.testing.assert_close(linear(module, x), 2 * torch.nn.functional.linear(x, module.weight, module.bias))


def test_on_short_lived_thread_returns_reraises_and_ends_its_thread():
    import threading

    from app.engine.model.setup import on_short_lived_thread

    seen: list[threading.Thread] = []

    def build() -> str:
        seen.append(threading.current_thread())
        return "built"

    assert on_short_lived_thread(build) == "built"
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def broken() -> None:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        on_short_lived_thread(broken)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 17, 96, 97])  # the kernel's tiles of 6 rows, either side of its limits
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_linear_equals_float32_on_the_rounded_weights(rows, bias):
    """bfloat16 weights, float32 rows: foreserve's kernels (one row: dot products; more: the packed
    panels), up to ``bf16_kernel_rows()`` rows, and oneDNN's float32 copy past them on a CPU without
    native bfloat16, all give the float32 product with the bfloat16-rounded weights. Past them on a
    CPU with native bfloat16 (and at every row count with AMX), oneDNN's bfloat16 kernel runs
    instead, whose rows go in and come out rounded to bfloat16; built with AVX512-BF16, the packed
    panels (2 rows or more) round the rows to bfloat16 and give the float32 product of the rounded
    rows and weights."""
    from app.engine.model.cpu_kernels import bf16_linear_op, bf16_pack_op, packed_rows_rounded
    from app.engine.model.cpu_linear import BF16Linear, bf16_kernel_rows, fast_linear, linear, native_bf16

    torch.manual_seed(rows)
    module = torch.nn.Linear(100, 36, bias=bias).to(torch.bfloat16)  # 100: not a multiple of 8
    x = torch.randn(rows, 100)
    want = torch.nn.functional.linear(x.double(), module.weight.double(),
                                      None if module.bias is None else module.bias.double())
    fast = fast_linear(module, bf16_linear_op(), bf16_pack_op())
    limit = bf16_kernel_rows()
    assert fast is not None and isinstance(fast, BF16Linear) == (limit > 0)
    assert limit == 0 or (fast.rows == limit and fast.packed is not None)
    float32_math = rows <= limit or not native_bf16()
    exact = {"rtol": 1e-5, "atol": 1e-5} if float32_math else {"rtol": 2e-2, "atol": 5e-2}
    if 1 < rows <= limit and packed_rows_rounded():
        want = torch.nn.functional.linear(x.bfloat16().double(), module.weight.double(),
                                          None if module.bias is None else module.bias.double())
    torch.testing.assert_close(linear(module, x, fast).double(), want, **exact)
    torch.testing.assert_close(linear(module, x).double(), want, rtol=2e-2, atol=5e-2)  # plain: bf16 math


@pytest.mark.parametrize(("native", "amx", "rounded", "rows"),
                         [(False, False, False, 96), (True, False, True, 96), (True, False, False, 16), (True, True, True, 0)])
def test_bf16_kernel_rows_follow_the_cpu(monkeypatch, native, amx, rounded, rows):
    """foreserve's kernels take bfloat16 linears of up to 96 rows without native bfloat16 (AVX2) and
    where they were built with AVX512-BF16 but there is no AMX, up to 16 where native bfloat16 met
    only their AVX2 micro-kernel (oneDNN's bfloat16 kernels past that), none with AMX."""
    from app.engine.model import cpu_kernels, cpu_linear

    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: native)
    monkeypatch.setattr(cpu_linear, "amx", lambda: amx)
    monkeypatch.setattr(cpu_kernels, "packed_rows_rounded", lambda: rounded)
    assert cpu_linear.bf16_kernel_rows() == rows


def test_fuse_rows_stacks_outputs_and_leaves_views():
    from app.engine.model.cpu_linear import fuse_rows

    torch.manual_seed(0)
    parts = [torch.nn.Linear(16, n, bias=True) for n in (8, 4, 4)]
    x = torch.randn(5, 16)
    want = torch.cat([p(x) for p in parts], dim=1)
    fused = fuse_rows(parts)
    torch.testing.assert_close(fused(x), want)
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=1), want)  # the parts still work
    assert parts[1].weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    assert fuse_rows([torch.nn.Linear(16, 4), torch.nn.Linear(8, 4)]) is None  # input sizes differ
    assert fuse_rows([torch.nn.Linear(16, 4), torch.nn.Linear(16, 4, bias=False)]) is None


def test_onednn_linears_run_at_a_few_row_counts_and_give_each_row_its_own_answer():
    """Rows are padded to one of a few counts (oneDNN keeps buffers per shape: exact counts made an
    engine's memory grow with every new count); the padded rows never reach the caller."""
    from app.engine.model.cpu_linear import onednn_linear, onednn_row_counts, onednn_rows, prepack

    assert [onednn_rows(n) for n in (1, 16, 17, 18, 19, 31, 33, 100, 256, 300)] == [1, 16, 18, 18, 20, 32, 36, 104, 256, 320]
    assert len(onednn_row_counts(512)) == 16 + 8 * 5  # 16 exact, then 8 per doubling
    assert onednn_row_counts(20) == [*range(1, 17), 18, 20]
    assert all(n <= onednn_rows(n) < n * 9 / 8 for n in range(1, 513))
    torch.manual_seed(0)
    module = torch.nn.Linear(64, 48)
    packed = prepack(module)
    if packed is None or packed.dtype != torch.float32:
        pytest.skip("oneDNN's float32 prepacked linear is not available here")
    for rows in (17, 100):
        x = torch.randn(rows, 64)
        got = onednn_linear(x, packed, module.bias)
        assert got.shape == (rows, 48)
        torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-5)
