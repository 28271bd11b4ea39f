"""Time to first token with no queue: single requests sent one at a time to each server, per
prompt length, so TTFT is the server's prefill plus its request path; then kvpage's own prefill
alone (`LLM.generate`, max_tokens=1) split by operator with torch.profiler.

    python bench/ttft_alone.py [--models 125m] [--servers kvpage,vllm] [--lengths 64,256,512,1000]
                               [--repeats 5] [--dtype float32] [--threads 2] [--no-profile]

Each server is started alone (bench/serving_servers.py, the serving benchmark's settings), warmed
with 3 requests, then sent `--repeats` requests per length (fresh random token ids each, so no
prefix-cache hit), streamed, 8 output tokens; min and median TTFT per length."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import serving_servers as ss  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from peers import vllm_cpu  # noqa: E402


async def _ttft(client: AsyncOpenAI, model: str, prompt: list[int]) -> float:
    start, first = time.perf_counter(), None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
    return first


async def _server_rows(served, name: str, args, vocab: int) -> list[str]:
    client = AsyncOpenAI(base_url=f"{served.url}/v1", api_key="none")
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    for _ in range(3):
        await _ttft(client, name, prompt(300))
    rows = []
    for n in args.lengths:
        times = [await _ttft(client, name, prompt(n)) * 1000 for _ in range(args.repeats)]
        rows.append(
            f"{n:>6} tokens: TTFT min {min(times):7.1f} ms, median {statistics.median(times):7.1f} ms"
        )
    return rows


def _profile(hf_dir: Path, args, vocab: int) -> None:
    import torch

    from kvpage import LLM, SamplingParams

    llm = LLM(model=str(hf_dir), dtype=args.dtype)
    rng, once, n = random.Random(args.seed + 1), SamplingParams(max_tokens=1), max(args.lengths)

    def fresh() -> list[list[int]]:  # new ids every call: no prefix-cache hit
        return [[rng.randrange(100, vocab) for _ in range(n)]]

    for _ in range(3):
        llm.generate(fresh(), once, use_tqdm=False)
    with torch.profiler.profile() as prof:
        llm.generate(fresh(), once, use_tqdm=False)
    print(f"\nkvpage prefill of {n} tokens, by operator (self CPU):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="125m")
    p.add_argument("--servers", default="kvpage,vllm")
    p.add_argument("--lengths", default="64,256,512,1000")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    import throughput

    with tempfile.TemporaryDirectory(prefix="kvpage-ttft-") as tmp:
        tmp = Path(tmp)
        model = throughput.build_model(args.models, 2048, str(tmp / "model"))
        vocab = model.config.vocab_size
        del model
        hf_dir = vllm_cpu.stage_model(tmp / "model", tmp / "served")
        setup = ss.ServerSetup(
            hf_dir=hf_dir, gguf=None, name="bench", dtype=args.dtype, threads=args.threads,
            max_seqs=32, max_model_len=2048, slot_ctx=1536, vllm_eager=False, workdir=tmp,
        )  # fmt: skip
        for server in args.servers.split(","):
            with ss.started(server, setup, "ttft") as served:
                rows = asyncio.run(_server_rows(served, "bench", args, vocab))
            print(f"\n{server} ({args.models}, {args.dtype}, {args.threads} threads):")
            print("\n".join(rows))
        if not args.no_profile:
            _profile(hf_dir, args, vocab)


if __name__ == "__main__":
    main()
