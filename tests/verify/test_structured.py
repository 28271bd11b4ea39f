"""Structured outputs in the gate: the reference's own matcher, the masked sampling oracle, the
independent output checker, the structured suite on the real engine (it passes, and exercises
what it is built for) and its mutants (each caught by the suite, attributed "structured")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvpage.verify.gate as gate
import kvpage.verify.structured
from kvpage.model import load_model
from kvpage.reference.grammar import ReferenceGrammars
from kvpage.sampling_params import SamplingParams
from kvpage.structured_params import StructuredOutputsParams
from kvpage.verify.case import RequestSpec
from kvpage.verify.cases.structured import ITEM_IDS, ITEM_NAMES, constraint, structured_cases
from kvpage.verify.diff import RequestContext, first_divergence
from kvpage.verify.gate import run_mutant
from kvpage.verify.generated import generate
from kvpage.verify.mutants.structured import STRUCTURED_MUTANTS
from kvpage.verify.sampling_oracle import (
    DrawSample,
    check_draw,
    oracle_probs,
    uniformity_test,
)
from kvpage.verify.structured import check_output, walk
from kvpage.verify.suites import Runtime, run_case
from tests.model.hf_models import save_hf

from .stack_dirs import build
from .test_diff import PROMPT, TOKENS, _logits, _trace
from .test_reference_independence import _kvpage_imports, reached_modules

MODEL = "builtin:tiny-llama"


@pytest.fixture(scope="module")
def runtime():
    model, tokenizer = load_model(MODEL)
    return Runtime(model, tokenizer, MODEL)


@pytest.fixture(scope="module")
def results(runtime):
    return {c.name: (c, run_case(c, runtime)) for c in structured_cases(258)}


# --- the reference's own constraint ------------------------------------------------------------
def _engine_grammar_code(names) -> list[str]:
    return sorted(
        n for n in names if n == "kvpage.structured" or n.startswith("kvpage.structured.")
    )


def test_the_reference_reaches_no_structured_engine_code():
    seen = reached_modules("kvpage.reference.generator")
    assert "kvpage.reference.grammar" in seen  # the walk reaches the reference's own
    assert not _engine_grammar_code(seen)
    # The checker and the oracle's walk import the reference's matcher, not the engine's.
    direct = _kvpage_imports(Path(kvpage.verify.structured.__file__))
    assert "kvpage.reference.grammar" in direct and not _engine_grammar_code(direct)
    assert not [n for n in direct if n.startswith("kvpage.engine")]


def test_the_reference_draws_only_what_its_grammar_allows(runtime):
    grammars = runtime.grammars
    for kind in ("ids", "regex", "choice", "grammar"):
        params = SamplingParams(max_tokens=40, structured_outputs=constraint(kind))
        out = runtime.reference(RequestSpec(kind, [256, 40, 41], params), block_size=8)
        assert out.finish_reason == "stop", kind
        assert walk(grammars, constraint(kind), out.token_ids).refused_at is None
        notes = [r.grammar for r in out.records]
        assert all(n["allowed"] >= 1 for n in notes) and notes[-1]["finished"]
        assert check_output(constraint(kind), grammars.text(out.token_ids)) is None


def test_the_walk_finds_a_token_outside_the_grammar(runtime):
    grammars = runtime.grammars
    text = json.dumps({"id": 7, "tag": "red"}, separators=(",", ":")).encode()
    good = walk(grammars, constraint("ids"), list(text))
    assert good.refused_at is None and good.stopped and len(good.masks) == len(text)
    assert bool(good.masks[0][ord("{")]) and int(good.masks[0].sum()) == 1
    bad = walk(grammars, constraint("ids"), list(b'{"id":x'))
    assert bad.refused_at == 6 and bad.error


def test_a_byte_table_mask_is_the_bitmask_unpacked(runtime):
    grammars = ReferenceGrammars(MODEL, 258, (257,))
    matcher = grammars.matcher(StructuredOutputsParams(regex="[0-9]+"))
    allowed = matcher.allowed()
    assert allowed.shape == (258,) and allowed.dtype == torch.bool
    assert torch.nonzero(allowed).flatten().tolist() == list(range(48, 58))


# --- the independent checker -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "text", "ok"),
    [
        ("ids", '{"id":12,"tag":"red"}', True),
        ("ids", '{"id":1200,"tag":"red"}', False),  # maximum 999
        ("ids", '{"id":12,"tag":"pink"}', False),
        ("ids", '{"id":12', False),
        ("names", '{"name":"abc","ok":true}', True),
        ("names", '{"name":"ABC","ok":true}', False),  # the pattern
        ("object", '{"a":[1]}', True),
        ("object", "[1]", False),
        ("regex", "abc-12", True),
        ("regex", "abc-1234", False),
        ("choice", "gamma", True),
        ("choice", "gam", False),
    ],
)
def test_the_checker(kind, text, ok):
    assert (check_output(constraint(kind), text) is None) is ok


# --- the masked sampling oracle ----------------------------------------------------------------
def _masked_setup():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    allowed = torch.tensor([False, False, True, True, True, False])
    return logits, allowed


def test_the_oracle_renormalises_over_the_mask():
    logits, allowed = _masked_setup()
    probs = oracle_probs(logits, 1.0, -1, 1.0, allowed)
    assert float(probs[~allowed].sum()) == 0.0 and abs(float(probs.sum()) - 1.0) < 1e-12
    expected = torch.softmax(logits[allowed].double(), dim=0)
    assert torch.allclose(probs[allowed], expected)
    top1 = oracle_probs(logits, 1.0, 1, 1.0, allowed)  # top-k over the allowed ids only
    assert int(torch.argmax(top1)) == 2 and float(top1[2]) == 1.0


def test_a_draw_outside_the_mask_or_off_its_argmax_fails():
    logits, allowed = _masked_setup()
    sampled = SamplingParams(temperature=1.0, top_k=2, max_tokens=4, seed=1)
    assert "grammar" in check_draw(logits, sampled, 0, allowed)
    assert check_draw(logits, sampled, 3, allowed) is None
    assert check_draw(logits, sampled, 4, allowed) is not None  # third of the allowed: top-k 2
    greedy = SamplingParams(max_tokens=4)
    assert check_draw(logits, greedy, 2, allowed) is None
    assert check_draw(logits, greedy, 0, None) is None and check_draw(logits, greedy, 2) is not None


def test_masked_draws_follow_the_masked_distribution_and_filter_first_draws_do_not():
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, seed=1)
    right, wrong = [], []
    for _ in range(400):
        logits = torch.randn(32, generator=gen) * 2
        allowed = torch.rand(32, generator=gen) < 0.3
        allowed[int(torch.randint(32, (1,), generator=gen))] = True
        probs = oracle_probs(logits, 1.0, 3, 1.0, allowed)
        token = int(torch.multinomial(probs.float(), 1, generator=gen))
        right.append(DrawSample(logits, params, token, allowed))
        # the engine's bug: top-k on the raw logits, the mask after; renormalised over what
        # is left (or any allowed id when nothing is)
        raw_top = oracle_probs(logits, 1.0, 3, 1.0) > 0
        kept = raw_top & allowed
        pool = kept if kept.any() else allowed
        token = int(torch.multinomial(pool.float(), 1, generator=gen))
        wrong.append(DrawSample(logits, params, token, allowed))
    assert uniformity_test(right).passed
    assert not uniformity_test(wrong).passed


# --- attribution -------------------------------------------------------------------------------
CONSTRAINED = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_a_constrained_token_from_the_same_logits_is_structured():
    ref = _trace(TOKENS, False, PROMPT)
    cand = _trace([7, 8, 4, 1, 2], True, PROMPT, {2: {"logits": _logits(9)}})
    ref[2].grammar = {"allowed": 2, "allowed_ids": [9, 11], "finished": False}
    a = first_divergence(ref, cand, context=RequestContext(CONSTRAINED)).attribution
    assert a.cls == "structured" and a.complete, a.missing
    assert a.fields["constraint"] == "regex" and a.fields["token"] == 4
    assert a.fields["allowed_next"]["allowed_ids"] == [9, 11]
    free = first_divergence(ref, cand, context=RequestContext(SamplingParams(max_tokens=5)))
    assert free.attribution.cls == "sampling"


def test_a_sampled_constrained_token_inside_its_mask_is_the_samplers():
    """The mask the reference's matcher allowed decides: a sampled token outside it was never
    drawable (structured); one inside it came from the right support, so its sampler chose it."""
    sampled = SamplingParams(
        temperature=0.8,
        max_tokens=5,
        seed=7,
        structured_outputs=StructuredOutputsParams(regex="a+"),
    )
    sampler = {"seed": 7, "generator_offset": 3, "generator_state": "00ff"}
    ref = _trace(TOKENS, False, PROMPT, {2: {"sampler": sampler}})
    cand = _trace([7, 8, 4, 1, 2], True, PROMPT, {2: {"logits": _logits(9), "sampler": sampler}})
    allowed = torch.zeros(ref[2].logits.shape[0], dtype=torch.bool)
    allowed[[4, 9]] = True
    ref[2].allowed = allowed
    ref[2].grammar = {"allowed": 2, "allowed_ids": [4, 9], "finished": False}
    inside = first_divergence(ref, cand, context=RequestContext(sampled)).attribution
    assert inside.cls == "sampling" and inside.complete, inside.missing
    assert set(inside.fields["support"]["ids"]) <= {4, 9}  # the masked support
    allowed[4] = False
    outside = first_divergence(ref, cand, context=RequestContext(sampled)).attribution
    assert outside.cls == "structured" and outside.complete


def test_running_past_a_complete_grammar_is_structured_not_a_stop_rule():
    ref = _trace(TOKENS[:3], False, PROMPT)
    ref[-1].grammar = {"allowed": 1, "allowed_ids": [9], "finished": True}
    cand = _trace(TOKENS, True, PROMPT)
    context = RequestContext(CONSTRAINED, "stop", "length", (257,))
    d = first_divergence(ref, cand, context=context)
    assert d.kind == "length" and d.attribution.cls == "structured" and d.attribution.complete
    ref[-1].grammar = {"allowed": 1, "allowed_ids": [9], "finished": False}
    context = RequestContext(CONSTRAINED, "stop", "length", (9, 257))  # it stopped on a stop id
    assert first_divergence(ref, cand, context=context).attribution.cls == "stop_rule"


# --- the suite on the real engine --------------------------------------------------------------
def test_the_suite_passes_on_the_engine(results):
    failed = {
        name: [f.message for f in r.failures] for name, (_, r) in results.items() if not r.passed
    }
    assert not failed


def test_a_bug_in_the_shared_schema_normalization_fails_the_suite(runtime, monkeypatch):
    """Engine, reference and the request share StructuredOutputsParams' normalized schema text:
    a bug there (here: "required" dropped) makes both draw alike, and only the checker, which
    validates against the schema as the case wrote it, can see it."""
    import kvpage.structured_params as structured_params

    honest = structured_params._schema_text

    def drops_required(schema):
        if isinstance(schema, dict):
            schema = {k: v for k, v in schema.items() if k != "required"}
        return honest(schema)

    monkeypatch.setattr(structured_params, "_schema_text", drops_required)
    case = next(c for c in structured_cases(258) if c.name == "mixed_batch")
    result = run_case(case, runtime)
    assert not result.passed
    assert any("is a required property" in f.message for f in result.failures)


def test_the_suite_exercises_its_paths(results, runtime):
    stops = 0
    for case, result in results.values():
        constrained = [s for s in case.requests if s.params.structured_outputs is not None]
        assert result.stats["grammar_compiles"] == len(
            {s.params.structured_outputs.digest for s in constrained}
        )
        for spec in constrained:
            for sample in range(spec.params.n):
                ref = runtime.reference(spec, case.engine["block_size"], sample)
                stops += ref.finish_reason == "stop"
    assert stops >= 20  # outputs the checker validates
    mixed = results["mixed_batch"][1]
    assert mixed.stats["grammar_cache_hits"] > 0 and mixed.stats["prefix_hits"] > 0
    assert results["preempted_recompute"][1].stats["preemptions_recompute"] > 0
    assert results["preempted_swap"][1].stats["preemptions_swap"] > 0
    schemas = [
        s.params.structured_outputs
        for s in results["mixed_batch"][0].requests
        if s.params.structured_outputs is not None and s.params.structured_outputs.kind == "json"
    ]
    titled = {so.digest for so in schemas if so.schema_name == ITEM_IDS["title"]}
    assert len(titled) == 2 and ITEM_NAMES["title"] == ITEM_IDS["title"]  # one title, two grammars


@pytest.mark.parametrize("mutant", STRUCTURED_MUTANTS, ids=lambda m: m.name)
def test_each_structured_mutant_is_caught_and_attributed(mutant, runtime):
    cases = structured_cases(runtime.model.config.vocab_size)
    result = run_mutant(mutant, runtime.model, runtime.tokenizer, MODEL, cases, runtime)
    assert result.caught and result.caught_by[0].startswith("structured/"), result.first_failure
    attribution = result.divergence["attribution"]
    assert attribution["class"] == "structured" and attribution["missing"] == [], attribution


@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_the_suite_passes_on_trained_tokenizers(kind, tmp_path):
    """A Hugging Face directory: the reference builds its matcher's tokenizer from the
    directory's tokenizer.json (read by itself), the engine from its own tokenizer."""
    directory = build(tmp_path / kind, kind)
    model, tokenizer = load_model(str(directory))
    runtime = Runtime(model, tokenizer, str(directory))
    case = next(c for c in structured_cases(model.config.vocab_size) if c.name == "mixed_batch")
    result = run_case(case, runtime)
    assert result.passed, [f.message for f in result.failures]
    stopped = 0
    for spec in case.requests:
        constraint = spec.params.structured_outputs
        if constraint is None or constraint.kind == "json_object":
            continue
        ref = runtime.reference(spec, case.engine["block_size"])
        if ref.finish_reason == "stop":
            text = runtime.grammars.text(ref.token_ids)
            assert check_output(constraint, text) is None, (spec.request_id, text)
            stopped += 1
    assert stopped >= 5


def test_without_a_tokenizer_the_structured_suite_and_mutants_are_not_applicable(tmp_path):
    """A model directory with no tokenizer.json: the engine refuses every constraint, so the
    constrained cases and the structured mutants are reported not applicable (neither passed
    nor caught), and generated scenarios draw no constraint."""
    save_hf("llama-mqa", tmp_path)
    names = [m.name for m in STRUCTURED_MUTANTS]
    result = gate.run_gate(
        str(tmp_path),
        suites=("structured", "stop"),
        mutants=names,
        progress=False,
        kv_cache_dtypes=(),
    )
    assert {c.suite for c in result.cases} == {"stop"}  # unconstrained cases still run
    assert set(result.cases_not_applicable) == {
        f"structured/{c.name}" for c in structured_cases(258)
    }
    assert all("tokenizer" in why for why in result.cases_not_applicable.values())
    assert {m.mutant.name for m in result.mutants} == set(names)
    assert all(m.not_applicable and not m.caught for m in result.mutants)
    scenarios = [generate(0, i, constraints=False) for i in range(20)]
    assert not any(r.structured for s in scenarios for r in s.requests)
    assert any(r.structured for i in range(20) for r in generate(0, i).requests)


def test_a_constrained_request_that_ran_past_its_stop_id_is_a_stop_rule():
    """The reference ended on a stop id (not its grammar); the candidate stopped one token
    later, on a token that is none: the stop rule's, not the grammar's."""
    ref = _trace(TOKENS[:3], False, PROMPT)  # ends on 9, a stop id
    ref[-1].grammar = {"allowed": 3, "allowed_ids": [1, 9], "finished": False}
    cand = _trace(TOKENS[:4], True, PROMPT)
    context = RequestContext(CONSTRAINED, "stop", "stop", (9, 257))
    a = first_divergence(ref, cand, context=context).attribution
    assert a.cls == "stop_rule" and a.complete, a.missing
