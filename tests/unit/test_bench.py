"""The benchmark CLI: bad input is a message, not a traceback (runs on the traces: tests/model/test_bench_traces.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "throughput", "--policies", "reserve_everything"], "unknown policy"),
        (["bench", "throughput", "--requests", "0"], "--requests must be >= 1"),
        (["bench", "throughput", "--sim", "H100-80G:llama-3-70b", "--policies", "hf_static"], "hf_* and llama_cpp_* peers"),
        (["bench", "throughput", "--sim", "TPU:llama-3-70b", "--tp", "2", "--policies", "paged"], "TPU"),
        (["bench", "throughput", "--step-trace", sys.executable], "--step-trace: a file, not a folder"),
    ],
)
def test_cli_rejects_bad_input_with_a_message(args, message):
    proc = subprocess.run([sys.executable, "-m", "foreserve.cli.main", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_help_lists_commands():
    proc = subprocess.run([sys.executable, "-m", "foreserve.cli.main", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for word in ("prepare", "bench", "generate"):
        assert word in proc.stdout


def test_linear_bandwidth_times_the_linears_a_decode_step_calls(tmp_path):
    import json

    from loadtests.bench.linear_bandwidth import step_shapes

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # per layer: q/k/v fused (64 + 2 * 32 rows), o, gate/up fused, down; then the LM head
    layer = [(128, 64), (64, 64), (256, 64), (64, 128)]
    assert step_shapes(tmp_path) == layer * 2 + [(100, 64)]
