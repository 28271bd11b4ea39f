"""Structured outputs' decode cost (issue 43): a batch with every row constrained, half of them,
or none, on the same prompts, one process.

    python bench/structured.py [--model 125m] [--requests 32] [--prompt 64] [--output 64]
                               [--constraint json|regex|regex-counted] [--rounds 3]
                               [--threads 2] [--profile]

The model is bench/throughput.py's (the 125m shape: 12 layers, d=768, a 32000-token vocabulary,
seeded random weights) with a byte-level BPE of 32000 tokens trained here on random words, so a
mask has a real vocabulary's shape to walk (tokens of one to many letters, digits, punctuation).
Each round runs, interleaved: `free` (`--requests` unconstrained requests), `constrained` (the
same requests, each with the constraint) and `half` (every other request constrained). Every
request ignores EOS and the constraints do not complete within `--output` tokens: `json` is an
object with one string of a fixed length (inside a string almost every token is allowed: the
widest masks), `regex` is `[a-z ]+` (about 85% of the vocabulary; a drawn EOS can end it) and
`regex-counted` is `[a-z ]{N}` (a counted repetition, which llguidance's lexer pays for at every
step). An untimed constrained run first (the warm-up) fixes each row's length, `--output` or
the shorter one where the grammar let the model draw EOS, and every mode decodes exactly those.
Reported per mode: decode ms per step (min / median over every step of every round; the first
step, the prefill, left out), tok/s at the median, the overhead against `free`, and the grammar
mask's own ms per step (Grammars.mask_rows: fill, unpack, apply). Checked: each row decodes its
length, the `half` batch's free rows give the `free` batch's tokens, and every constrained
output is a prefix its constraint allows (Python's `re`). `--profile` adds a cProfile of one
constrained run's decode steps.
CPU contention skews everything: run it on an otherwise idle machine."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import re
import statistics
import string
import tempfile
import time
from pathlib import Path

import torch
from throughput import MODELS, build_model

from kvpage import LLMEngine, SamplingParams, StructuredOutputsParams
from kvpage.config import EngineConfig
from kvpage.model import load_model

MODES = ("free", "constrained", "half")
SPECIALS = ["<unk>", "<s>", "</s>"]  # pad, bos, eos: bench/throughput.py's ids 0, 1, 2


def train_tokenizer(directory: Path, vocab_size: int, seed: int = 0) -> None:
    """A byte-level BPE of `vocab_size` tokens trained on random words (syllables drawn with
    skewed letter weights, some capitalised, numbers and punctuation between them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    rng = random.Random(seed)
    letters = string.ascii_lowercase
    weights = [rng.random() ** 2 for _ in letters]
    syllables = ["".join(rng.choices(letters, weights, k=rng.randint(1, 4))) for _ in range(3000)]

    def word() -> str:
        w = "".join(rng.choices(syllables, k=rng.randint(1, 3)))
        return w.capitalize() if rng.random() < 0.1 else w

    lines = []
    for _ in range(60000):
        words = [word() for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(words) + rng.choice('.,:;!?-"'))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def constraint(kind: str, output: int) -> tuple[StructuredOutputsParams, re.Pattern]:
    """The constraint, and a pattern every prefix of its outputs matches. A length is past what
    `output` tokens of at most 32 characters reach, so it never completes."""
    length = 32 * output
    if kind == "regex":  # unbounded: EOS may end it, which the random model all but never draws
        return StructuredOutputsParams(regex="[a-z ]+"), re.compile(r"[a-z ]*")
    if kind == "regex-counted":  # llguidance walks a counted repetition's lexer at a cost
        return StructuredOutputsParams(regex=f"[a-z ]{{{length}}}"), re.compile(r"[a-z ]*")
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": length, "maxLength": length}},
        "required": ["text"],
        "additionalProperties": False,
    }
    structured = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return structured, re.compile(r'\{"text":"(?s:.)*')


def mask_seconds(engine: LLMEngine, before: dict[str, int]) -> list[float]:
    """The mean seconds a masking step took since `before` (the engine's own count,
    LLM.stats()' grammar_mask_us over grammar_masked_steps); [] when nothing was masked."""
    after = engine.stats()
    steps = after["grammar_masked_steps"] - before["grammar_masked_steps"]
    return [(after["grammar_mask_us"] - before["grammar_mask_us"]) / 1e6 / steps] if steps else []


def run(model, tokenizer, args, mode: str, prompts, structured, lengths, profile=None):
    """(decode step seconds, mask seconds per step, request id -> (token ids, text, finish)).
    Request i decodes lengths[i] tokens (ignoring EOS)."""
    config = EngineConfig(
        model=args.directory,
        num_blocks=args.requests * -(-(args.prompt + args.output) // 16) + 4,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, args.requests * args.prompt),
    )
    engine = LLMEngine(config, model, tokenizer)
    for i, prompt in enumerate(prompts):
        constrained = mode == "constrained" or (mode == "half" and i % 2 == 0)
        params = SamplingParams(
            max_tokens=lengths[i],
            ignore_eos=True,
            structured_outputs=structured if constrained else None,
        )
        engine.add_request(str(i), prompt, params)
    engine.step()  # every prompt prefilled at once: the budget holds them all
    before = engine.stats()
    times, final = [], {}
    if profile is not None:
        profile.enable()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        for o in outs:
            if o.finished:
                s = o.outputs[0]
                final[o.request_id] = (s.token_ids, s.text, s.finish_reason)
    if profile is not None:
        profile.disable()
    return times, mask_seconds(engine, before), final


def check(finals: dict, pattern: re.Pattern, lengths: list[int], output: int) -> list[str]:
    """What went wrong: a row that did not decode its length (a constrained row its grammar
    ended early ends with "stop", any other with "length"), a free row of `half` whose tokens
    differ from `free`'s, a constrained text its constraint does not allow."""
    problems = []
    for mode, final in finals.items():
        for rid, (tokens, text, finish) in final.items():
            constrained = mode == "constrained" or (mode == "half" and int(rid) % 2 == 0)
            ended = "stop" if constrained and lengths[int(rid)] < output else "length"
            if len(tokens) != lengths[int(rid)] or finish != ended:
                problems.append(f"{mode} {rid}: {len(tokens)} tokens, {finish}")
            if constrained and not pattern.fullmatch(text):
                problems.append(f"{mode} {rid}: {text[:40]!r} is outside the constraint")
            if mode == "half" and not constrained and tokens != finals["free"][rid][0]:
                problems.append(f"half {rid}: a free row's tokens differ from the free batch's")
    return problems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(MODELS), default="125m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--constraint", choices=("json", "regex", "regex-counted"), default="json")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        args.directory = tmp
        hf = build_model(args.model, args.prompt + args.output + 16, tmp)
        vocab = hf.config.vocab_size
        del hf
        train_tokenizer(Path(tmp), vocab, args.seed)
        model, tokenizer = load_model(tmp)
        structured, pattern = constraint(args.constraint, args.output)
        rng = random.Random(args.seed)
        prompts = [
            [rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.requests)
        ]
        # An untimed constrained run (the warm-up) says how long each row is: `--output`, or
        # shorter where the grammar let the model end it (a drawn EOS); every mode then decodes
        # exactly those lengths.
        _, _, pilot = run(
            model,
            tokenizer,
            args,
            "constrained",
            prompts,
            structured,
            [args.output] * args.requests,
        )
        lengths = [len(pilot[str(i)][0]) for i in range(args.requests)]
        times = {m: [] for m in MODES}
        masks = {m: [] for m in MODES}
        finals = {}
        for _ in range(max(1, args.rounds)):
            for mode in MODES:  # interleaved round by round
                ts, ms, finals[mode] = run(
                    model, tokenizer, args, mode, prompts, structured, lengths
                )
                times[mode] += ts
                masks[mode] += ms
        report(args, times, masks)
        short = [n for n in lengths if n < args.output]
        print(f"rows the grammar ended early (EOS): {len(short)} {short}")
        problems = check(finals, pattern, lengths, args.output)
        print(f"checks: {'all passed' if not problems else '; '.join(problems[:5])}")
        if args.profile:
            prof = cProfile.Profile()
            run(model, tokenizer, args, "constrained", prompts, structured, lengths, prof)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
            print(out.getvalue())


def report(args, times: dict, masks: dict) -> None:
    print(
        f"\n{args.model}, {args.requests} requests, prompt {args.prompt}, output {args.output}, "
        f"constraint {args.constraint}, {args.threads} threads, {args.rounds} rounds"
    )
    free_min, free_med = min(times["free"]), statistics.median(times["free"])
    print(
        f"{'mode':>12} {'min ms':>8} {'median ms':>10} {'tok/s':>8} {'overhead min':>13} "
        f"{'med':>6} {'mask ms med':>12}"
    )
    for mode in MODES:
        ts, med = times[mode], statistics.median(times[mode])
        mask = statistics.median(masks[mode]) * 1e3 if masks[mode] else 0.0
        print(
            f"{mode:>12} {min(ts) * 1e3:8.2f} {med * 1e3:10.2f} {args.requests / med:8.1f} "
            f"{min(ts) / free_min - 1:12.1%} {med / free_med - 1:6.1%} {mask:12.3f}"
        )


if __name__ == "__main__":
    main()
