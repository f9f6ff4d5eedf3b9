"""The simulated runner's cost model and profiles: fast, no model loading."""

from __future__ import annotations

import pytest

from app.engine.sim.profiles import HARDWARE, MODELS, ModelProfile, kv_budget_bytes_per_rank, parse_sim_spec
from app.engine.outputs import ScheduledChunk, SchedulerOutput
from app.engine.request import SamplingParams
from app.engine.sim.runner import DUMMY_TOKEN_ID, SimRunner

SP = SamplingParams(max_tokens=16)


def chunk(i: int, n: int, start: int, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(f"r{i}", [7] * n, start, [], sample, SP, 0)


def decode(batch: int, ctx: int) -> list[ScheduledChunk]:
    return [chunk(i, 1, ctx) for i in range(batch)]


H100_8B = SimRunner(HARDWARE["H100-80G"], MODELS["llama-3-8b"], 1)


def test_model_params_match_published_sizes():
    assert MODELS["llama-3-8b"].num_params == pytest.approx(8.03e9, rel=0.01)
    assert MODELS["llama-3-70b"].num_params == pytest.approx(70.55e9, rel=0.01)
    assert MODELS["smollm2-135m"].num_params == pytest.approx(134.5e6, rel=0.01)
    # K and V, 8 KV heads x 128 wide, bf16: 128 KiB/token (8B), 320 KiB/token (70B)
    assert MODELS["llama-3-8b"].kv_bytes_per_token == 131072
    assert MODELS["llama-3-70b"].kv_bytes_per_token == 327680
    assert MODELS["llama-3-70b"].kv_bytes_per_token_per_rank(2) == 327680 // 2
    assert MODELS["llama-3-70b"].kv_bytes_per_token_per_rank(8) == 327680 // 8
    assert MODELS["llama-3-70b"].kv_bytes_per_token_per_rank(16) == 327680 // 8  # KV heads replicated


def test_from_hf_config_matches_registry():
    class Cfg:  # the shape of transformers' LlamaConfig for SmolLM2-135M
        num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads = 30, 576, 9, 3
        head_dim, intermediate_size, vocab_size, tie_word_embeddings = 64, 1536, 49152, True

    assert ModelProfile.from_hf_config("smollm2-135m", Cfg) == MODELS["smollm2-135m"]


def test_decode_batch1_is_weights_over_bandwidth():
    weights_s = MODELS["llama-3-8b"].weight_bytes / HARDWARE["H100-80G"].hbm_bandwidth_bytes_per_s
    assert weights_s == pytest.approx(4.8e-3, rel=0.02)
    step = H100_8B.step_time_s(decode(1, 128))
    assert 4.5e-3 < step < 7e-3
    cost = H100_8B.step_cost(decode(1, 128))
    assert not cost.compute_bound and cost.comm_s == 0.0


def test_step_time_grows_with_batch_and_context():
    times = [H100_8B.step_time_s(decode(b, 1000)) for b in (1, 8, 32, 128)]
    assert times == sorted(times) and times[-1] > 1.5 * times[0]
    by_ctx = [H100_8B.step_time_s(decode(32, c)) for c in (100, 1000, 4000)]
    assert by_ctx == sorted(by_ctx) and by_ctx[-1] > by_ctx[0] * 1.3
    # decode stays memory-bound even at a large batch
    assert not H100_8B.step_cost(decode(128, 1000)).compute_bound


def test_large_prefill_is_compute_bound():
    cost = H100_8B.step_cost([chunk(0, 4096, 0)])
    assert cost.compute_bound
    flops = 2 * MODELS["llama-3-8b"].num_params * 4096
    ideal_s = flops / HARDWARE["H100-80G"].peak_flops
    assert ideal_s < cost.total_s < 3 * ideal_s
    # a prefill chunk behind a long cached prefix pays for attention over the prefix
    assert H100_8B.step_time_s([chunk(0, 512, 6000)]) > H100_8B.step_time_s([chunk(0, 512, 0)])
    # per token, prefill is far cheaper than decode
    assert cost.total_s / 4096 < H100_8B.step_time_s(decode(1, 0)) / 20


def test_tp2_halves_memory_time_but_adds_all_reduce():
    tp2 = SimRunner(HARDWARE["H100-80G"], MODELS["llama-3-8b"], 2)
    one, two = H100_8B.step_cost(decode(8, 512)), tp2.step_cost(decode(8, 512))
    assert two.memory_s == pytest.approx(one.memory_s / 2, rel=0.05)
    assert two.comm_s > 0 and one.comm_s == 0
    assert one.total_s / 2 < two.total_s < one.total_s
    # all-reduce traffic grows with the tokens in the step
    assert tp2.step_cost([chunk(0, 2048, 0)]).comm_s > 2 * two.comm_s
    assert tp2.kv_bytes_per_token == H100_8B.kv_bytes_per_token // 2


def test_70b_does_not_fit_one_80g_gpu():
    with pytest.raises(ValueError, match=r"does not fit on H100-80G with tp=1.*tensor-parallel size 2"):
        SimRunner(HARDWARE["H100-80G"], MODELS["llama-3-70b"], 1)
    with pytest.raises(ValueError, match="does not fit"):
        kv_budget_bytes_per_rank(HARDWARE["A100-80G"], MODELS["llama-3-70b"], 1)


@pytest.mark.parametrize("hw", ["H100-80G", "A100-80G"])
def test_70b_tp2_leaves_about_10gb_kv_per_gpu(hw):
    runner = SimRunner.from_spec(f"{hw}:llama-3-70b", tp_size=2)
    assert 8e9 <= runner.kv_budget_bytes() <= 12e9
    assert runner.kv_bytes_per_token == 163840
    assert 50_000 < runner.kv_budget_tokens() < 75_000
    # H200 has room to spare
    assert SimRunner.from_spec("H200:llama-3-70b", tp_size=2).kv_budget_bytes() > 60e9


def test_bad_tp_is_rejected():
    with pytest.raises(ValueError, match="attention heads cannot be split"):
        SimRunner(HARDWARE["H100-80G"], MODELS["smollm2-135m"], 2)
    with pytest.raises(ValueError, match=">= 1"):
        SimRunner(HARDWARE["H100-80G"], MODELS["llama-3-8b"], 0)


def test_execute_samples_a_non_eos_token_for_sampling_chunks():
    runner = SimRunner.from_spec("H200:llama-3-8b")
    assert runner.simulated and runner.eos_token_id is None
    out = runner.execute(SchedulerOutput([chunk(0, 100, 0, sample=False), chunk(1, 1, 50), chunk(2, 30, 10)]))
    assert out.sampled_token_ids == {"r1": DUMMY_TOKEN_ID, "r2": DUMMY_TOKEN_ID}
    assert out.step_s > 0
    assert runner.execute(SchedulerOutput([chunk(1, 1, 50), chunk(2, 30, 10)])).step_s < out.step_s
    assert runner.execute(SchedulerOutput([])).step_s == HARDWARE["H200"].overhead_s
    runner.shutdown()
    runner.shutdown()


def test_parse_sim_spec():
    hw, model = parse_sim_spec("H100-80G:llama-3-70b")
    assert hw.name == "H100-80G" and model.name == "llama-3-70b"
    with pytest.raises(ValueError, match=r"unknown hardware 'V100'.*A100-80G, H100-80G, H200"):
        parse_sim_spec("V100:llama-3-8b")
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'.*llama-3-8b, llama-3-70b"):
        parse_sim_spec("H200:gpt-5")
    for bad in ("H100-80G", "H100-80G:", ":llama-3-8b", ""):
        with pytest.raises(ValueError, match="HARDWARE:MODEL"):
            parse_sim_spec(bad)
