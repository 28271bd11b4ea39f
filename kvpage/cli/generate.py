"""`kvpage generate`: one prompt through the contiguous reference (or a tensor-parallel engine)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvpage.cli.common import (
    CliError,
    add_engine_flag,
    add_model_args,
    add_tensor_parallel,
    count,
    number,
    token_ids,
)
from kvpage.errors import WorkerFailure
from kvpage.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from kvpage.engine.outputs import RequestOutput


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    add_model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    prompt.add_argument("--prompt-ids", type=token_ids, help="comma-separated prompt token ids")
    gen.add_argument("--max-tokens", type=count, default=32, help="tokens to generate")
    gen.add_argument("--temperature", type=number(float, 0.0), default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=-1, help="-1: all tokens")
    gen.add_argument("--top-p", type=number(float, 0.0, 1.0), default=1.0, help="nucleus mass")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens")
    add_structured_args(gen)
    add_engine_flag(
        gen, "kv_cache_dtype", help="K/V round trip of the reference (auto: as computed)"
    )
    add_engine_flag(
        gen,
        "quantization",
        help="the linear layers' weights (int8: per-output-channel weight-only int8)",
    )
    add_engine_flag(gen, "quantize_lm_head")
    add_engine_flag(gen, "speculative_config")  # runs the paged engine (the reference does not)
    add_tensor_parallel(gen)
    gen.set_defaults(func=run)


def add_structured_args(gen) -> None:
    """One constraint on the output (SamplingParams.structured_outputs), at most."""
    group = gen.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", help="a JSON schema: its JSON text, or @FILE")
    group.add_argument("--regex", help="the output matches this regular expression")
    group.add_argument("--choice", action="append", help="the output is one of these (repeat)")
    group.add_argument("--grammar", help="a Lark or GBNF grammar: its text, or @FILE")
    group.add_argument("--json-object", action="store_true", help="any JSON object")
    gen.add_argument(
        "--disable-any-whitespace", action="store_true", help="JSON without whitespace"
    )


def structured_outputs(args: argparse.Namespace) -> StructuredOutputsParams | None:
    fields = {
        "json": _text_or_file(args.json_schema),
        "regex": args.regex,
        "choice": args.choice,
        "grammar": _text_or_file(args.grammar),
        "json_object": args.json_object,
    }
    chosen = {k: v for k, v in fields.items() if v not in (None, False)}
    if not chosen:
        return None
    return StructuredOutputsParams(**chosen, disable_any_whitespace=args.disable_any_whitespace)


def _text_or_file(value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as err:
        raise CliError(f"cannot read {value[1:]}: {err}") from None


def run(args: argparse.Namespace) -> int:
    from kvpage.model import load_model
    from kvpage.model.tokenizer import encode_text
    from kvpage.reference.generator import generate

    params = SamplingParams(  # checked before the model loads
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        structured_outputs=structured_outputs(args),
    )
    if args.quantize_lm_head and args.quantization != "int8":
        raise CliError("--quantize-lm-head needs --quantization int8")
    model, tokenizer = load_model(
        args.model, args.dtype, args.device, args.quantization, args.quantize_lm_head
    )
    if args.prompt is not None:
        prompt_ids = encode_text(tokenizer, args.prompt, args.model)
    else:
        prompt_ids = args.prompt_ids
    metrics = None
    if args.tensor_parallel_size > 1 or args.speculative_config is not None:
        request = _generate_engine(args, model, tokenizer, prompt_ids, params)
        out, metrics = request.outputs[0], request.metrics
    else:
        grammars = None
        if params.structured_outputs is not None:
            grammars = _reference_grammars(args.model, model, params)
        kv = args.kv_cache_dtype
        out = generate(model, prompt_ids, params, kv_cache_dtype=kv, grammars=grammars)
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(out.token_ids)!r}")
    print(f"prompt_ids: {prompt_ids}")
    print(f"token_ids: {out.token_ids}")
    print(f"finish_reason: {out.finish_reason}")
    if args.speculative_config is not None:
        accepted, drafted = metrics.num_accepted_tokens, metrics.num_draft_tokens
        print(f"speculative: {accepted} of {drafted} draft tokens accepted")
    return 0


def _reference_grammars(name: str, model, params: SamplingParams):
    """The reference's own grammars, the request's constraint compiled once up front: a
    constraint it cannot compile is a one-line error, not a traceback."""
    from kvpage.reference.grammar import ReferenceGrammars

    grammars = ReferenceGrammars(name, model.config.vocab_size, model.config.eos_token_ids)
    try:
        grammars.matcher(params.structured_outputs)
    except ValueError as err:
        raise CliError(str(err).splitlines()[0]) from None
    return grammars


def _generate_engine(args, model, tokenizer, prompt_ids, params) -> RequestOutput:
    """One request through the paged engine: tensor-parallel, or speculating (the one-process
    path above runs the contiguous reference, which has no paged pool to shard and does not
    speculate)."""
    from kvpage.config import EngineConfig
    from kvpage.engine.engine import LLMEngine

    placement = {"tensor_parallel_size": args.tensor_parallel_size}
    if args.tensor_parallel_size == 1:  # the tensor-parallel engine runs on CPU (gloo)
        placement["device"] = args.device
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        speculative_config=args.speculative_config,
        **placement,
    )
    engine = LLMEngine(config, model, tokenizer)
    finished = []
    try:
        engine.add_request("0", prompt_ids, params)
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
    finally:
        engine.shutdown()
    out = finished[0]
    if out.outputs[0].finish_reason == "error":
        raise WorkerFailure(out.error)
    return out
