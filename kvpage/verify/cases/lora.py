"""LoRA adapters: base and two adapters on the same prompt in one step (each equals its
reference, the reference merging the adapter's files in its own code; no block shared across
adapters, the same adapter shares), a reload under the same name, an adapter named like a
tenant's salt, adapters under preemption (recompute and swap) with a parallel request, an
rsLoRA adapter with alpha != rank, one slot reused by an adapter with fewer targets, an adapter
with per-module ranks and alphas (rank_pattern, alpha_pattern), and prompt logprobs of adapter
requests (each row against the adapter's merged reference, kept rows served to a hit of the
same adapter only). Every
request states how many cached tokens it must get: an adapter left out of the key would share
KV silently where two adapters agree on a token.

Every adapter is a PEFT directory the engine loads by path (kvpage.verify.lora_adapters), and
`check_adapters` holds what it loaded to what was written: its digest to the verifier's own
hash of the files, and a reload under the same name with other tensor bytes to a namespace of
its own."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpage.lora.adapter import LoraAdapter
from kvpage.reference.records import StepRecord
from kvpage.sampling_params import SamplingParams
from kvpage.verify.case import Case, RequestSpec, Tokens, greedy, preempt_at_step
from kvpage.verify.checks import Failure, finding
from kvpage.verify.lora_adapters import LoraSpec, WrittenAdapter

SUITE = "lora"
B = 8
A = LoraSpec("a", seed=101)
BB = LoraSpec("b", seed=102, targets=("q_proj", "v_proj", "down_proj"), rank=8, alpha=8.0)
A_RELOADED = replace(A, seed=103)  # the same name and config, other tensor bytes
# rsLoRA with alpha != rank: scale 16 / sqrt(8), where alpha / r would be 2 (a loader that
# misses use_rslora serves it at under half its strength)
RS = LoraSpec("rs", seed=104, rank=8, alpha=16.0, rslora=True)
# Fewer targets than A, to follow A in A's slot (max_loras=1): A's other five projections must
# not stay behind in the slot
QV = LoraSpec("qv", seed=105, targets=("q_proj", "v_proj"), rank=2, alpha=6.0)
# Per-module ranks and alphas (PEFT's rank_pattern / alpha_pattern, first matching key wins):
# v_proj rank 6 in layer 1, 3 in layer 0, down_proj 8, the rest 2; layer 0's q_proj alpha 24
# (the specific key first), every other q_proj 1 (a reader that lets the last key win scales
# layer 0's q_proj by 1 / 2 where 24 / 2 is due), the rest 4.
PAT = LoraSpec(
    "pat",
    seed=106,
    rank=2,
    alpha=4.0,
    rank_pattern=(
        ("layers.1.self_attn.v_proj", 6),
        ("layers.0.self_attn.v_proj", 3),
        ("down_proj", 8),
    ),
    alpha_pattern=(("layers.0.self_attn.q_proj", 24.0), ("q_proj", 1.0)),
)


def lora_cases(vocab: int) -> list[Case]:
    t = Tokens(vocab, seed=2500)
    cases = [_mixed(t), _reload(t), _named_like_a_salt(t), _preempted(t)]
    return cases + [_rslora(t), _slot_reused(t), _patterns(t), _prompt_rows(t)]


@dataclass(slots=True)
class LoadedAdapter:
    """What the engine loaded for one adapter request: `adapter` is the engine's registered
    adapter under the name right after the request was added (None: none)."""

    sample_id: str  # the request's first sample (its trace key)
    written: WrittenAdapter
    adapter: LoraAdapter | None


def check_adapters(
    loaded: list[LoadedAdapter],
    records: dict[str, list[StepRecord]],
    refs: dict[str, list[StepRecord]],
) -> list[Failure]:
    """The engine read what was written: each loaded adapter's digest is the verifier's own
    hash of the files at its path, and two requests under one name whose files differ (a
    reload, even one that changes only tensor bytes) run in different namespaces."""
    failures: list[Failure] = []

    def fields(item: LoadedAdapter) -> dict:
        cand, ref = records.get(item.sample_id) or [], refs.get(item.sample_id) or []
        return {
            "adapter_ref": item.written.identity,
            "adapter_cand": None if item.adapter is None else item.adapter.identity,
            "namespace_ref": ref[0].view.namespace if ref else "",
            "namespace_cand": cand[0].view.namespace if cand else "",
            "batch_adapters": list(cand[0].batch_adapters) if cand else [],
            "prefix_hit_tokens": cand[0].prefix_hit_tokens if cand else 0,
            "path": item.written.path,
        }

    def fail(kind: str, message: str, item: LoadedAdapter) -> None:
        div = finding(kind, "lora", message, fields(item), item.sample_id)
        failures.append(Failure("adapter", message, item.sample_id, div))

    for item in loaded:
        got = None if item.adapter is None else item.adapter.digest
        if got == item.written.digest:
            continue
        message = (
            f"adapter {item.written.spec.name!r} loaded from {item.written.path} has digest "
            f"{str(got)[:16]}, the files written there hash to {item.written.digest[:16]}"
        )
        fail("adapter_digest", message, item)
    first: dict[tuple[str, str], LoadedAdapter] = {}  # (name, files digest) -> first request
    for item in loaded:
        first.setdefault((item.written.spec.name, item.written.digest), item)
    distinct = list(first.values())
    for i, item in enumerate(distinct):
        for other in distinct[i + 1 :]:
            name = item.written.spec.name
            mine, theirs = fields(item)["namespace_cand"], fields(other)["namespace_cand"]
            if other.written.spec.name != name or not mine or mine != theirs:
                continue
            message = (
                f"{other.sample_id} ran adapter {name!r} from other files than "
                f"{item.sample_id} (a reload) in the same namespace {mine[:16]}"
            )
            fail("adapter_reload", message, other)
    return failures


def _pool(**more) -> dict:
    """The suite's engine: 8-token blocks, 64 of them, and `more`."""
    return dict(block_size=B, num_blocks=64, **more)


def _one_prompt(
    prompt: list[int], rows: list[tuple], max_tokens: int = 4
) -> tuple[list[RequestSpec], dict[str, int]]:
    """Greedy requests of one prompt, a row each: (id, adapter or None, arrival step, the cached
    tokens it must be served); their specs and those expected hits."""
    specs = [
        RequestSpec(rid, prompt, greedy(max_tokens), at, lora=lora) for rid, lora, at, _ in rows
    ]
    return specs, {rid: hits for rid, _, _, hits in rows}


def _mixed(t: Tokens) -> Case:
    prompt, full = t.take(3 * B + 2), 3 * B
    specs, hits = _one_prompt(
        prompt,
        [
            ("base.1", None, 0, 0),
            ("a.1", A, 0, 0),
            ("b.1", BB, 0, 0),
            ("a.2", A, 16, full),
            ("b.2", BB, 16, full),
            ("base.2", None, 16, full),
        ],
        max_tokens=5,
    )
    specs.append(RequestSpec("a.other", t.take(2 * B + 3), greedy(5), 0, lora=A))
    what = "base and two adapters in one batch, then each again"
    return Case(SUITE, what, specs, _pool(), expect_hit_tokens=hits)


def _reload(t: Tokens) -> Case:
    prompt, full = t.take(3 * B + 1), 3 * B
    specs, hits = _one_prompt(
        prompt,
        [("old", A, 0, 0), ("reloaded", A_RELOADED, 8, 0), ("reloaded.2", A_RELOADED, 16, full)],
    )
    what = "an adapter reloaded under its name with other weights"
    return Case(SUITE, what, specs, _pool(), expect_hit_tokens=hits)


def _named_like_a_salt(t: Tokens) -> Case:
    prompt = t.take(3 * B + 1)
    specs = [
        RequestSpec("salted", prompt, greedy(4), 0, cache_salt="a"),
        RequestSpec("adapter", prompt, greedy(4), 8, lora=A),
    ]
    return Case(
        SUITE,
        "adapter 'a' against the tenant salt 'a'",
        specs,
        _pool(),
        expect_hit_tokens={"salted": 0, "adapter": 0},
    )


def _preempted(t: Tokens) -> Case:
    shared = t.take(2 * B + 2)
    sampled = SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=7, ignore_eos=True)
    specs = [
        RequestSpec("r", shared + t.take(5), greedy(8), lora=A),
        RequestSpec("s", shared + t.take(7), greedy(8), lora=BB),
        RequestSpec("n", shared + t.take(3), sampled, lora=A),
        RequestSpec("base", shared + t.take(4), greedy(8)),
    ]
    return Case(
        SUITE,
        "adapters preempted by recompute and swap, a parallel request with an adapter",
        specs,
        _pool(max_num_batched_tokens=16),
        actions=[
            preempt_at_step("preempt r", 3, "r", 0, 2),
            preempt_at_step("swap s", 4, "s", 0, 2, "swap"),
        ],
        expect_preemption=True,
    )


def _rslora(t: Tokens) -> Case:
    """An rsLoRA adapter (alpha / sqrt(r)) beside the base model, then again from its blocks."""
    prompt, full = t.take(2 * B + 3), 2 * B
    specs, hits = _one_prompt(
        prompt, [("rs.1", RS, 0, 0), ("base", None, 0, 0), ("rs.2", RS, 8, full)]
    )
    return Case(
        SUITE, "an rsLoRA adapter with alpha != rank", specs, _pool(), expect_hit_tokens=hits
    )


def _slot_reused(t: Tokens) -> Case:
    """One adapter slot: A (all seven projections) holds it, QV (two, a lower rank) waits for
    it while a base request runs beside A, takes it over, then A takes it back and hits its own
    blocks. QV must see nothing of A's factors."""
    prompt, full = t.take(3 * B + 1), 3 * B
    specs, hits = _one_prompt(
        prompt, [("all", A, 0, 0), ("qv", QV, 0, 0), ("base", None, 0, 0), ("all.2", A, 14, full)]
    )
    what = "one adapter slot reused by an adapter with fewer targets"
    return Case(SUITE, what, specs, _pool(max_loras=1), expect_hit_tokens=hits)


def _patterns(t: Tokens) -> Case:
    """The pattern adapter beside A and the base model, then again from its own blocks."""
    prompt, full = t.take(2 * B + 5), 2 * B
    specs, hits = _one_prompt(
        prompt,
        [("pat.1", PAT, 0, 0), ("a", A, 0, 0), ("base", None, 0, 0), ("pat.2", PAT, 8, full)],
    )
    what = "an adapter with per-module ranks and alphas (rank_pattern, alpha_pattern)"
    return Case(SUITE, what, specs, _pool(), expect_hit_tokens=hits)


def _scored(k: int) -> SamplingParams:
    return SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=k)


def _prompt_rows(t: Tokens) -> Case:
    """Prompt logprobs of base, A and BB on one prompt in one step (each row checked against
    its own reference: kvpage.verify.cases.prompt_logprobs.check_prompt_logprobs); then A and
    the base again, each hitting its own blocks and served the rows kept with them, and BB
    asking for more rows than it kept (no hit: rows must be computed)."""
    prompt, full = t.take(3 * B + 2), 3 * B
    rows = [
        ("rows.base", None, 0, 0, 2),
        ("rows.a", A, 0, 0, 2),
        ("rows.b", BB, 0, 0, 3),
        ("rows.a.2", A, 10, full, 2),
        ("rows.base.2", None, 10, full, 1),
        ("rows.b.2", BB, 10, 0, 5),
    ]
    specs = [RequestSpec(rid, prompt, _scored(k), at, lora=lora) for rid, lora, at, _, k in rows]
    hits = {rid: n for rid, _, _, n, _ in rows}
    what = "prompt logprobs with adapters, then served from each adapter's kept rows"
    return Case(SUITE, what, specs, _pool(), expect_hit_tokens=hits)
