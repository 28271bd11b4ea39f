"""Declared seams: the strategies and guards of the engine that the verifier may replace.

A mutant (kvpage.verify.mutants) plants a bug in one engine instance by replacing one of these, or
by wrapping a public method; it never touches a private name (an AST test holds every mutant to
that). A seam is named `owner.attribute`, the owner found from the engine along `OWNERS`; each is
a public method whose contract is its docstring, so renaming or removing one fails the mutants
that use it loudly (`kvpage.verify.mutants.base.MissingSeam`) instead of as "missed" mutants.

Forced preemption, holds and failure injection are not seams: a test driver makes them from
public calls between steps (kvpage.verify.driver)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Seam:
    owner: str  # a key of OWNERS
    attribute: str
    what: str

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.attribute}"


# How each owner is reached from an LLMEngine.
OWNERS: dict[str, str] = {
    "engine": "",
    "scheduler": "scheduler",
    "cache": "cache",
    "index": "cache.index",
    "pool": "cache.pool",
    "sampler": "sampler",
    "scorer": "prompt_scorer",
    "runner": "runner",
    "rows": "scheduler.prompt_rows",
    "lora": "lora_slots",  # an engine made with enable_lora
    "lora_reader": "lora_slots.reader",
    "lora_tables": "lora_slots.tables",
    "grammars": "grammars",  # structured outputs (kvpage.engine.grammars)
    # built at the first constrained request (or when a seam of it is planted); a model with
    # no tokenizer has none
    "grammar_compiler": "grammars.compiler",
    "speculation": "speculation",  # an engine made with a speculative_config
}

SEAMS: dict[str, Seam] = {
    s.name: s
    for s in (
        Seam("scheduler", "choose_victim", "which running request is preempted for room"),
        Seam("scheduler", "restore_chunk", "how many tokens a swapped request comes back with"),
        Seam("scheduler", "may_admit", "whether waiting requests may be admitted this step"),
        Seam("scheduler", "fits_worst_case", "the reservation with preemption off (worst case)"),
        Seam("scheduler", "acquire_prefix", "the admission's prefix lookup (what it shares)"),
        Seam("scheduler", "count_lookup", "which admissions count as prefix queries and hits"),
        Seam("scheduler", "prompt_hit_blocks", "the hit cap of a prompt-logprob request"),
        Seam("scheduler", "stop_reason", "the stop rule after each appended token"),
        Seam("cache", "cow_needed", "the copy-on-write decision"),
        Seam("cache", "max_hit_blocks", "how much of a prompt a prefix hit may cover"),
        Seam("cache", "new_key_chain", "the block-key builder (chained digests)"),
        Seam("cache", "trim", "which blocks a sliding-window layer group gives back"),
        Seam("cache", "hit_tables", "the hybrid prefix-hit rule over the layer groups"),
        Seam("index", "confirmed", "the digest confirmation of a fast-key hit"),
        Seam("index", "match", "the prefix lookup's walk down the index"),
        Seam("index", "choose_victim", "which cached block is evicted (LRU leaf)"),
        Seam("sampler", "sample", "the sampler: one token per row"),
        Seam("runner", "check_batch", "the packed batch's layout guard (cu_seqlens)"),
        Seam("engine", "namespace", "the namespace requests are keyed in (salted per tenant)"),
        Seam("scorer", "prompt_logprob_rows", "prompt logits rows -> prompt logprobs"),
        Seam("rows", "key_of", "what a block's kept prompt rows are keyed by (its digest)"),
        Seam("rows", "is_live", "whether kept rows' block incarnation still stands"),
        Seam("rows", "rows_for", "kept rows -> a hit request's prompt logprobs"),
        Seam("engine", "request_namespace", "a request's namespace: salt and adapter identity"),
        Seam("runner", "adapter_rows", "a mixed batch's rows grouped by adapter"),
        Seam("lora", "factors", "a resident adapter's low-rank factors and scale"),
        Seam("lora_reader", "digest", "a loaded adapter's digest (config and tensor bytes)"),
        Seam("lora_reader", "scale", "a loaded adapter's scale from its config (rsLoRA)"),
        Seam("lora_reader", "pattern_key", "the rank_pattern / alpha_pattern key of a module"),
        Seam("lora_tables", "clear_slot", "what a slot's write zeroes first (every projection)"),
        Seam("engine", "patch_kv_shards", "the KV pool's code on every rank (quantize, copy…)"),
        Seam("grammars", "mask_rows", "the step's grammar masks, one per constrained row"),
        Seam("grammars", "fork", "a parallel sample's own copy of its parent's matcher"),
        Seam("grammars", "replay", "the matcher rebuilt from the output after recompute"),
        Seam("grammar_compiler", "cache_key", "what a compiled grammar is cached by"),
        Seam("scheduler", "commit_verified", "a speculative step's kept KV: roll back, publish"),
        Seam("speculation", "verify", "the rule that keeps drafts and adds the target's token"),
        Seam("speculation", "propose", "the drafts each speculating sequence runs with"),
    )
}


def owner_of(engine, seam: Seam):
    """The object that holds `seam` in this engine."""
    obj = engine
    for part in filter(None, OWNERS[seam.owner].split(".")):
        obj = getattr(obj, part)
    return obj
