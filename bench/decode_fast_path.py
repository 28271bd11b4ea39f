"""The decode fast path (the decode tape: the module forward's kernel calls, recorded and
replayed) against the module forward, per model family, in one process, round by round:

    python bench/decode_fast_path.py [--families llama,qwen2-window,...] [--seqs 1]
                                     [--rounds 3] [--steps 20] [--threads 2] [--dtype bfloat16]

Each family is the 125M shape of throughput.py (d 768, 12 layers, 12 heads / 4 KV heads,
intermediate 2048, vocab 32000) in that family's transformers config, saved and loaded by kvpage.
Two engines per family decode the same `--seqs` requests of 128 random tokens: one with every
fast path on (`fast path`: the decode tape where it takes the family's steps), one bound without
the tape (`module`: EngineConfig.fast_paths_off, the module forward on the same kernels);
each round times `--steps` steps of one, then of the other (which goes first alternates). Prints per family the ms per step of each (min and
median over rounds of each round's median step) and module / fast path; a family whose steps
no tape took reads ~1.0x (both rows run the module forward) and says so."""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
import transformers
from throughput import BLOCK_SIZE, FIRST_TOKEN_ID, INIT_STD, MODELS

from kvpage import LLM, SamplingParams

PROMPT = 128
OFF = ("decode_plan",)  # the module forward: everything else bound as the fast path's
SHAPE = MODELS["125m"]
# model_type -> the family's own fields beside the shared shape
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2-window": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=64, max_window_layers=6),
    ),
    "qwen3": ("qwen3", dict(head_dim=64)),
    "phi3-partial": ("phi3", dict(partial_rotary_factor=0.5)),
    "mistral-window": ("mistral", dict(sliding_window=64, head_dim=64)),
    "gemma3": ("gemma3_text", dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=64)),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=4)),
    "gpt2": ("gpt2", dict(n_inner=2048)),  # 12 heads of 64, MHA (GPT-2 has no KV heads)
}


def save(family: str, directory: str) -> None:
    model_type, extra = FAMILIES[family]
    torch.manual_seed(1234)
    cfg = transformers.AutoConfig.for_model(
        model_type,
        **SHAPE,
        **extra,
        max_position_embeddings=1024,
        initializer_range=INIT_STD,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    transformers.AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(directory)


def engine(directory: str, args, off: tuple[str, ...]) -> LLM:
    gen = 8 + args.rounds * (args.steps + 2)
    llm = LLM(
        directory,
        block_size=BLOCK_SIZE,
        num_blocks=args.seqs * -(-(PROMPT + gen) // BLOCK_SIZE),
        max_num_seqs=args.seqs,
        dtype=args.dtype,
        seed=0,
        fast_paths_off=off,
    )
    rng = random.Random(0)
    vocab = llm.engine.model.config.vocab_size
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    for i in range(args.seqs):
        prompt = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(PROMPT)]
        llm.engine.add_request(f"r{i}", prompt, params)
    while any(not seq.output_ids for seq in llm.engine.seqs.values()):
        llm.engine.step()
    return llm


def timed_steps(llm: LLM, steps: int) -> float:
    """The median wall time of `steps` engine steps, in ms (after 2 untimed ones)."""
    for _ in range(2):
        llm.engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(family: str, args) -> None:
    with tempfile.TemporaryDirectory() as directory:
        save(family, directory)
        engines = {"fast path": engine(directory, args, ()), "module": engine(directory, args, OFF)}
        ms: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
                ms[name].append(timed_steps(engines[name], args.steps))
        model = engines["fast path"].engine.model
        tape = getattr(model, "decode_plan", lambda: None)()
        covered = tape is not None and bool(tape.recorded())
        same = tokens(engines["fast path"]) == tokens(engines["module"])
    for name, rows in ms.items():
        print(
            f"{family:>15} {name:>9}: {min(rows):7.2f} ms/step (median {statistics.median(rows):7.2f})"
        )
    ratio = min(ms["module"]) / min(ms["fast path"])
    med = statistics.median(ms["module"]) / statistics.median(ms["fast path"])
    note = "" if covered else "  (no fast path for this family: both rows are the module forward)"
    print(
        f"{family:>15} module / fast path: {ratio:.3f}x (median {med:.3f}x), tokens equal: {same}{note}"
    )


def tokens(llm: LLM) -> list[list[int]]:
    return [list(seq.output_ids) for _, seq in sorted(llm.engine.seqs.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.dtype}, {args.seqs} seqs x "
        f"{PROMPT} prompt tokens, {args.rounds} rounds x {args.steps} decode steps per binding"
    )
    for family in args.families.split(","):
        measure(family, args)


if __name__ == "__main__":
    main()
