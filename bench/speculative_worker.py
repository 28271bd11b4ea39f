"""One kvpage process of bench/speculative.py: an LLM with or without a speculative_config, on the
workloads of a JSON spec, one request at a time.

    python bench/speculative_worker.py SPEC.json OUT.json

SPEC: model_dir, dtype, seed, threads, speculative_config (vLLM's dict, or null: plain decoding),
workloads [{name, prompt, max_tokens}], and optionally gaps (true: a diagnostic run that also
returns each position's top-2 logprob gap). The engine is built and warmed up once (untimed, with the
same config, so a draft model is warm too), then each workload runs once, greedy, EOS ignored.
OUT per workload: wall (the generate call), decode_s (its end minus the request's
first_token_time), tokens, and spec (the spec_decode_* counters of LLM.stats() over that call
alone; null without speculation).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from kvpage import LLM, SamplingParams

BLOCK_SIZE = 16
SPEC_KEYS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def build(spec: dict) -> LLM:
    longest = max(len(w["prompt"]) + w["max_tokens"] for w in spec["workloads"])
    kwargs = (
        {}
        if spec["speculative_config"] is None
        else {"speculative_config": spec["speculative_config"]}
    )
    llm = LLM(
        spec["model_dir"], dtype=spec["dtype"], device="cpu", seed=spec["seed"],
        block_size=BLOCK_SIZE, num_blocks=2 * -(-(longest + 64) // BLOCK_SIZE) + 16, **kwargs,
    )  # fmt: skip
    rng = random.Random(spec["seed"] + 1)
    warm = [1] + [rng.randrange(259, llm.engine.model.config.vocab_size) for _ in range(47)]
    llm.generate([warm], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    return llm


def run_one(llm: LLM, workload: dict, speculative: bool, gaps: bool = False) -> dict:
    """`gaps` (a diagnostic run, not a timed one): also each output position's top-2 logprob
    gap, how near a tie its greedy token was."""
    logprobs = 2 if gaps else None
    params = SamplingParams(max_tokens=workload["max_tokens"], ignore_eos=True, logprobs=logprobs)
    before = llm.stats()
    start = time.monotonic()
    out = llm.generate([workload["prompt"]], params, use_tqdm=False)[0]
    end = time.monotonic()
    after = llm.stats()
    spec = {k: after[k] - before[k] for k in SPEC_KEYS} if speculative else None
    result = {
        "wall": end - start,
        "decode_s": end - out.metrics.first_token_time,
        "tokens": list(out.outputs[0].token_ids),
        "spec": spec,
    }
    if gaps:
        tops = [sorted(lp.values(), reverse=True) for lp in out.outputs[0].logprobs]
        result["gaps"] = [top[0] - top[1] for top in tops]
    return result


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    llm = build(spec)
    load_s = time.perf_counter() - t0
    speculative = spec["speculative_config"] is not None
    gaps = spec.get("gaps", False)
    results = {w["name"]: run_one(llm, w, speculative, gaps) for w in spec["workloads"]}
    llm.close()
    Path(out_path).write_text(json.dumps({"load_s": load_s, "workloads": results}))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
