"""The gate's cases, one module per suite (kvpage.verify.case describes what a case is)."""

from __future__ import annotations

from kvpage.verify.case import Case
from kvpage.verify.cases.batching import batching_cases
from kvpage.verify.cases.failure import failure_cases
from kvpage.verify.cases.layer_groups import layer_group_cases
from kvpage.verify.cases.lora import lora_cases
from kvpage.verify.cases.namespaces import namespace_cases
from kvpage.verify.cases.parallel import parallel_cases
from kvpage.verify.cases.policy import policy_cases
from kvpage.verify.cases.preemption import preemption_cases
from kvpage.verify.cases.prefix import prefix_cases
from kvpage.verify.cases.prompt_logprobs import prompt_logprob_cases
from kvpage.verify.cases.quantized import REQUANTIZED_SUITES, cow_case, quantized_copies
from kvpage.verify.cases.resources import resource_cases
from kvpage.verify.cases.sampling import sampling_cases
from kvpage.verify.cases.speculative import speculative_cases
from kvpage.verify.cases.stop import stop_cases
from kvpage.verify.cases.structured import structured_cases

SUITES = (
    "prefix",
    "batching",
    "preemption",
    "failure",
    "sampling",
    "stop",
    "resources",
    "namespaces",
    "policy",
    "parallel",
    "prompt_logprobs",
    "lora",
    "structured",
    "speculative",
)
# Suites that need a model of a given shape, run by the cells of such a model (kvpage.verify
# .matrix): layer_groups needs global and sliding-window layers (builtin:tiny-hybrid).
SHAPED_SUITES = ("layer_groups",)
ALL_SUITES = (*SUITES, *SHAPED_SUITES)
BLOCK_SIZES = (8, 16)


def build_suites(
    vocab: int, suites: tuple[str, ...] = SUITES, kv_cache_dtypes: tuple[str, ...] = ()
) -> list[Case]:
    """The cases of `suites`; then, for each quantized KV dtype, the prefix, batching and
    preemption cases among them again in that format, and its copy-on-write fork case."""
    cases: list[Case] = []
    if "prefix" in suites:
        for block_size in BLOCK_SIZES:
            cases += prefix_cases(vocab, block_size)
    if "batching" in suites:
        cases += batching_cases(vocab)
    if "preemption" in suites:
        cases += preemption_cases(vocab)
    if "failure" in suites:
        cases += failure_cases(vocab)
    builders = {
        "sampling": sampling_cases,
        "stop": stop_cases,
        "resources": resource_cases,
        "namespaces": namespace_cases,
        "policy": policy_cases,
        "parallel": parallel_cases,
        "prompt_logprobs": prompt_logprob_cases,
        "lora": lora_cases,
        "structured": structured_cases,
        "speculative": speculative_cases,
        "layer_groups": layer_group_cases,
    }
    for name, build in builders.items():
        if name in suites:
            cases += build(vocab)
    base = list(cases)
    for kv_cache_dtype in kv_cache_dtypes:
        cases += quantized_copies(base, kv_cache_dtype) + [cow_case(vocab, kv_cache_dtype)]
    return cases


def quantized_suite_names(suites: tuple[str, ...], kv_cache_dtypes: tuple[str, ...]):
    """Names of the suites build_suites adds for the quantized dtypes."""
    return tuple(
        name
        for d in kv_cache_dtypes
        for name in (*(f"{s}:{d}" for s in suites if s in REQUANTIZED_SUITES), f"parallel:{d}")
    )
