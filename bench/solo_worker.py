"""One engine process of `throughput.py`'s solo mode (bench/solo_rounds.py starts it): kvpage
`LLM.generate` or HF `generate`, in the project's venv, on the workloads of a JSON spec.

    python bench/solo_worker.py SPEC.json OUT.json

SPEC: engine ("kvpage" | "hf"), model_dir, dtype (bench/solo.py's PRECISIONS: float32, bfloat16,
int8 and int8-bf16, int8 weights and LM head with float32 / bfloat16 activations), seed, threads, hf_batch, workloads
[{name, prompts, max_tokens}]. The engine is built and warmed up once (untimed), then each
workload runs once, timed around the generate call alone; OUT: load_s and per workload
{wall, tokens}. kvpage: the throughput.py engine settings (block size 16, prefix caching on, a
pool that holds the largest workload); HF: static left-padded batches of hf_batch, greedy, EOS
disabled (throughput.run_hf_generate).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import solo
import torch
import transformers
from throughput import Workload, blocks_needed, kvpage_llm, random_tokens, run_hf_generate

from kvpage import SamplingParams


def run_kvpage(spec: dict, workloads: list[Workload]) -> dict:
    pool = max(blocks_needed(wl) for wl in workloads)
    dtype, int8 = solo.PRECISIONS[spec["dtype"]]  # int8: weights and LM head
    quant = "int8" if int8 else "none"
    llm = kvpage_llm(spec["model_dir"], pool, True, spec["seed"], dtype, 1, quant, int8)  # warms
    results = {}
    for wl in workloads:
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        results[wl.name] = {"wall": wall, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    llm.close()
    return results


def run_hf(spec: dict, workloads: list[Workload]) -> dict:
    dtype = getattr(torch, spec["dtype"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # EOS never ends a run (kvpage: ignore_eos)
    rng = random.Random(spec["seed"] + 3)
    vocab = model.config.vocab_size
    warm = Workload("warm", [random_tokens(rng, 48, vocab) for _ in range(4)], [8] * 4)
    run_hf_generate(model, warm, 4)()
    results = {}
    for wl in workloads:
        run = run_hf_generate(model, wl, spec["hf_batch"])
        t0 = time.perf_counter()
        out = run()
        results[wl.name] = {"wall": time.perf_counter() - t0, "tokens": out.tokens}
    return results


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    workloads = [Workload(w["name"], w["prompts"], w["max_tokens"]) for w in spec["workloads"]]
    t0 = time.perf_counter()
    run = {"kvpage": run_kvpage, "hf": run_hf}[spec["engine"]]
    results = run(spec, workloads)
    total = time.perf_counter() - t0
    Path(out_path).write_text(json.dumps({"process_s": total, "workloads": results}))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
