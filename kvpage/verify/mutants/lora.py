"""LoRA mutants, the bugs engines shipped: the adapter left out of the block key (vLLM #3264),
adapters told apart by name alone so a reload serves the old blocks (vLLM #30931, #42125), the
adapter's name written where the tenant salt goes so the two collide (vLLM #44701), an adapter
applied to the wrong rows of a mixed batch, and a wrong scale; and in how the engine reads an
adapter and reuses its slot: a digest that skips the tensor bytes (a reload under the same name
with other weights is served the old namespace's blocks), rsLoRA read from a misspelled key
(alpha / r where alpha / sqrt(r) was asked for), and a slot reused by an adapter with fewer
targets keeping its previous adapter's factors for the others; and on int8 weights, the delta
scaled by the weight scales (LoRA fused into a quantized GEMM's epilogue). Per-module ranks and
alphas read with the last matching pattern key winning, or every module scaled by the config's
own alpha / r; and prompt logprobs scored by a pass that leaves the adapters out (an adapter
request's prompt rows are the base model's, its tokens right). Each replaces a declared seam
(the last also wraps the runner's public `run`)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import replace as replaced

import torch

from kvpage.engine.engine import LLMEngine
from kvpage.lora.apply import AdapterRows, LoraBatch
from kvpage.model.int8 import Int8Linear
from kvpage.verify.mutants.base import Mutant, bind, mutant_table, plant


def adapter_left_out(engine: LLMEngine) -> None:
    plant(
        engine,
        "engine.request_namespace",
        lambda self, salt, adapter: self.namespace.with_salt(salt),
    )


def keyed_by_name(engine: LLMEngine) -> None:
    def namespace(self, salt, adapter):
        base = self.namespace.with_salt(salt)
        return base if adapter is None else base.with_adapter(adapter.name)

    plant(engine, "engine.request_namespace", namespace)


def name_in_salt_field(engine: LLMEngine) -> None:
    def namespace(self, salt, adapter):
        return self.namespace.with_salt(salt if adapter is None else adapter.name)

    plant(engine, "engine.request_namespace", namespace)


def rows_shifted(engine: LLMEngine) -> None:
    """Each adapter group's rows moved one row on (a mixed batch's offsets off by one)."""
    honest = engine.runner.adapter_rows

    def adapter_rows(self, batch):
        found = honest(batch)
        if found is None:
            return None
        total = batch.cu_seqlens_q[-1]
        groups = []
        for g in found.groups:
            rows = torch.arange(total) if g.rows is None else g.rows
            groups.append(AdapterRows(g.adapter, (rows + 1) % total))
        return LoraBatch(groups)

    plant(engine, "runner.adapter_rows", adapter_rows)


def alpha_not_divided_by_rank(engine: LLMEngine) -> None:
    if engine.lora_slots is None:
        return  # an engine serving no adapters has no scale to get wrong: the bug is inert
    honest = engine.lora_slots.factors

    def factors(self, adapter):
        return {k: (a, b * adapter.rank) for k, (a, b) in honest(adapter).items()}

    plant(engine, "lora.factors", factors)


def digest_skips_tensors(engine: LLMEngine) -> None:
    """The adapter's digest over its config alone: the tensor bytes never reach it."""
    if engine.lora_slots is None:
        return  # an engine serving no adapters loads none: the bug is inert

    def digest(self, cfg, tensors):
        return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()

    plant(engine, "lora_reader.digest", digest)


def rslora_key_misspelled(engine: LLMEngine) -> None:
    """rsLoRA looked up under a key no PEFT config has: every adapter gets alpha / r."""
    if engine.lora_slots is None:
        return

    def scale(self, cfg, rank, alpha):
        return alpha / math.sqrt(rank) if cfg.get("use_rs_lora") else alpha / rank

    plant(engine, "lora_reader.scale", scale)


def slot_keeps_old_factors(engine: LLMEngine) -> None:
    """A slot's write zeroes only the projections the new adapter targets: one with fewer
    targets than the slot's previous adapter runs with that adapter's other factors."""
    if engine.lora_slots is None:
        return

    def clear_slot(self, slot, factors):
        lo, hi = slot * self.max_rank, (slot + 1) * self.max_rank
        for where in factors:
            if where in self.stacks:
                a_stack, b_stack = self.stacks[where]
                a_stack[:, lo:hi] = 0
                b_stack[lo:hi] = 0

    plant(engine, "lora_tables.clear_slot", clear_slot)


def int8_delta_times_scales(engine: LLMEngine) -> None:
    """LoRA fused into the int8 GEMM's epilogue ahead of the dequantisation: y = (x codes^T +
    x A^T B^T) * scale, so each row's delta comes out multiplied by the projection's
    per-output-channel weight scales (a few 1e-3: the adapter all but vanishes). Planted where
    every path that adds the delta reads it (the module forward, a decode tape's replay, every
    rank's shard): the resident factors, scale * B^T's output columns times the scales of the
    engine's int8 layers. On float weights there are no scales: inert, and the gate runs it on
    int8 weights only (Mutant.weights)."""
    if engine.lora_slots is None:
        return
    scales = int8_scales(engine.model)
    honest = engine.lora_slots.factors

    def factors(self, adapter):
        out = {}
        for where, (a_t, b_t) in honest(adapter).items():
            scale = scales.get(where)
            out[where] = (a_t, b_t if scale is None else b_t * scale.to(b_t)[None, :])
        return out

    plant(engine, "lora.factors", factors)


def int8_scales(model) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, projection) -> the int8 layer's per-output-channel scales, for a Llama-shaped
    model's decoder layers (none for float layers)."""
    found = {}
    for index, layer in enumerate(model.model.layers):
        for owner in (layer.self_attn, layer.mlp):
            for name, child in owner.named_children():
                if isinstance(child, Int8Linear):
                    found[index, name] = child.scales
    return found


def pattern_last_key_wins(engine: LLMEngine) -> None:
    """rank_pattern / alpha_pattern matched by every key in turn, the last match kept (a loop
    without its break): a module two keys match gets the general key's value."""
    if engine.lora_slots is None:
        return

    def pattern_key(self, keys, module):
        found = None
        for key in keys:
            if re.match(rf"(.*\.)?({key})$", module):
                found = key
        return found

    plant(engine, "lora_reader.pattern_key", pattern_key)


def module_scale_ignored(engine: LLMEngine) -> None:
    """Every module's B scaled by the config's lora_alpha / r: alpha_pattern and rank_pattern
    change the factors' shapes but never their scale."""
    if engine.lora_slots is None:
        return
    honest = engine.lora_slots.factors

    def factors(self, adapter):
        return {
            where: (a, b * (adapter.scale / adapter.scale_of(where)))
            for where, (a, b) in honest(adapter).items()
        }

    plant(engine, "lora.factors", factors)


def prompt_rows_without_adapter(engine: LLMEngine) -> None:
    """A step that scores an adapter request's prompt rows takes them from a pass with no
    adapter rows (the prompt rows' LoRA mapping forgotten), then runs the step as it should
    (its KV written again with the adapters, its sampled tokens right)."""
    if engine.lora_slots is None:
        return
    runner = engine.runner
    honest_rows, honest_run = runner.adapter_rows, runner.run
    base_pass = [False]

    def adapter_rows(self, batch):
        return None if base_pass[0] else honest_rows(batch)

    def run(self, batch):
        if all(rows.seq.lora is None for rows in batch.prompt_rows):
            return honest_run(batch)
        base_pass[0] = True
        try:
            base = honest_run(batch)
        finally:
            base_pass[0] = False
        return replaced(honest_run(batch), prompt_logits=base.prompt_logits)

    plant(engine, "runner.adapter_rows", adapter_rows)
    bind(runner, "run", run)


LORA_MUTANTS = mutant_table(
    "lora",
    (
        (
            "lora_left_out_of_namespace",
            "the adapter is not part of the block key",
            adapter_left_out,
        ),
        (
            "lora_keyed_by_name",
            "adapters keyed by name alone: a reload hits old blocks",
            keyed_by_name,
        ),
        ("lora_name_in_salt_field", "the adapter name keyed as a tenant salt", name_in_salt_field),
        (
            "lora_rows_shifted",
            "an adapter applied to the wrong rows of a mixed batch",
            rows_shifted,
        ),
        ("lora_wrong_scale", "lora_alpha not divided by the rank", alpha_not_divided_by_rank),
        (
            "lora_digest_skips_tensors",
            "the adapter digest skips the tensor bytes: a reload is served old blocks",
            digest_skips_tensors,
        ),
        (
            "lora_rslora_key_misspelled",
            "use_rslora read from a misspelled key: alpha / r instead of alpha / sqrt(r)",
            rslora_key_misspelled,
        ),
        (
            "lora_slot_keeps_old_factors",
            "a reused slot keeps the previous adapter's factors for projections it lacks",
            slot_keeps_old_factors,
        ),
        (
            "lora_pattern_last_key_wins",
            "rank_pattern / alpha_pattern: the last matching key wins, not the first",
            pattern_last_key_wins,
        ),
        (
            "lora_module_scale_ignored",
            "every module scaled by lora_alpha / r, its own rank and alpha ignored",
            module_scale_ignored,
        ),
    ),
    suites=("lora",),
) + (
    Mutant(
        "lora_int8_delta_times_scales",
        "the LoRA delta multiplied by the int8 projection's weight scales (a fused epilogue)",
        "lora",
        int8_delta_times_scales,
        suites=("lora",),
        weights="int8",
    ),
)
# Caught by the lora suite's prompt-logprob rows: a prompt_logprobs finding.
LORA_MUTANTS += (
    Mutant(
        "lora_prompt_rows_without_adapter",
        "an adapter request's prompt logprobs computed without the adapter",
        "prompt_logprobs",
        prompt_rows_without_adapter,
        suites=("lora",),
    ),
)
