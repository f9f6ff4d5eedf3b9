"""The runner's CUDA path on a GPU box: greedy tokens against transformers' own ``generate`` on the
same device, then ``bench throughput`` there.

How it ran for the README (the lent H100 box takes 64 MiB from here and has no network, so no real
weights): a SmolLM2-135M of the real shapes with random weights (``initializer_range`` 0.1, seed 0)
is written over ``$FORESERVE_HOME/models/SmolLM2-135M-Instruct`` (config and tokenizer copied
there, with the validation trace), pydantic comes as wheels, and ``OUT`` names the output folder:
``FORESERVE_HOME=/tmp/home OUT=/tmp/out python3 loadtests/cuda_check.py``. On a GPU machine with
foreserve installed and prepared, run ``foreserve bench throughput`` directly (device ``auto``).
NOTE: it overwrites the model folder it is given: never point it at your real data dir.
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    if os.environ.get("FORESERVE_HOME") in (None, "", str(Path.home() / ".cache" / "foreserve")):
        sys.exit("set FORESERVE_HOME to a scratch data dir: this check overwrites its model with random weights")
    home = os.environ["FORESERVE_HOME"]
    mdir = f"{home}/models/SmolLM2-135M-Instruct"
    cfg = AutoConfig.from_pretrained(mdir)
    cfg.initializer_range = 0.1  # peakier logits than the default 0.02: fewer near-ties for greedy
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(mdir)
    print("torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)

    from app.config import EngineConfig
    from app.engine.engine import LLMEngine
    from app.engine.request import EngineRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(mdir)
    prompts = ["Name three colors.", "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child."]
    ref = model.to("cuda").eval()
    expected = {}
    for i, p in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        ids = tok(ids, add_special_tokens=False, return_tensors="pt").input_ids.to("cuda")
        out = ref.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected[str(i)] = (ids[0].tolist(), out[0, ids.shape[1]:].tolist())
    del ref
    engine = LLMEngine.from_config(EngineConfig(kv_cache_tokens=4096, device="cuda"))
    print("runner device", engine.runner.device, flush=True)
    for i, (ids, _) in expected.items():  # one batch, chunked prefill mixed with decode
        engine.add_request(EngineRequest(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), request_id=i))
    got = {i: [] for i in expected}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    same = {i: got[i] == expected[i][1] for i in expected}
    prefix = {i: next((k for k, (a, b) in enumerate(zip(got[i], expected[i][1])) if a != b), 32) for i in expected}
    print("greedy tokens equal to transformers generate on cuda:", same, "first mismatch at", prefix, flush=True)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "equal": same, "first_mismatch": prefix}
    json.dump(result, open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w"), indent=2)
    engine.shutdown()

    import app.prepare.traces as traces
    traces.ensure_traces = lambda force=False: Path(home) / "traces"  # no ShareGPT package there: the copied trace
    from foreserve.cli.main import main
    for kv in (16384,):
        main(["bench", "throughput", "--requests", "256", "--max-tokens", "1024", "--kv-tokens", str(kv),
              "--policies", "reserve_max,paged,reserve_predicted,oracle", "--predictor", "oracle",
              "--json", os.path.join(os.environ["OUT"], f"gpu_throughput_kv{kv}.json")])


if __name__ == "__main__":
    main()
