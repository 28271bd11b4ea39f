"""A generated scenario as plain data: an engine configuration, requests and events, all of it
JSON, so a failing scenario is a file anyone can replay (`kvpage verify --replay FILE`). The
generator (kvpage.verify.generated.generator) makes them, the shrinker makes them smaller, and
`to_case` turns one into an ordinary verification case: every check a hand-written case gets,
a generated one gets too."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from kvpage.engine.sequence import SeqStatus
from kvpage.reference.weight_oracle import reference_model
from kvpage.sampling_params import SamplingParams
from kvpage.structured_params import StructuredOutputsParams
from kvpage.verify.case import Action, Case, RequestSpec, status_of
from kvpage.verify.driver import StepDriver
from kvpage.verify.lora_adapters import LoraSpec

FORMAT = "kvpage-scenario/1"
SUITE = "generated"


@dataclass(slots=True)
class RequestScenario:
    request_id: str
    prompt: list[int]
    arrive_step: int = 0
    max_tokens: int = 8
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = True
    stop_token_ids: list[int] = field(default_factory=list)
    stop_at_ref_step: int | None = None  # stop on the reference's own token at this step
    logprobs: int | None = None
    cache_salt: str | None = None
    timeout_s: float | None = None
    prompt_logprobs: int | None = None
    # A LoRA adapter (kvpage.verify.lora_adapters.LoraSpec's fields: name, seed, targets, rank,
    # alpha, rslora), written as a PEFT directory and loaded by path; None: the base model.
    lora: dict | None = None
    # [position, rank]: the prompt's token at `position` becomes, when the scenario is run on a
    # model, the rank-th most likely next token after prompt[:position] in the reference (a
    # prompt-logprob hit whose next token is among its writer's kept top k). Without a model the
    # drawn token stays.
    top_next: list[int] | None = None
    # StructuredOutputsParams' fields (json: the schema as an object; regex; choice; ...);
    # None: the request is free (kvpage.verify.generated.constraints)
    structured: dict | None = None

    def lora_spec(self) -> LoraSpec | None:
        if self.lora is None:
            return None
        return LoraSpec(**{**self.lora, "targets": tuple(self.lora["targets"])})

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids),
            logprobs=self.logprobs,
            n=self.n,
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=None
            if self.structured is None
            else StructuredOutputsParams(**self.structured),
        )

    def spec(self) -> RequestSpec:
        return RequestSpec(
            self.request_id,
            list(self.prompt),
            self.params(),
            self.arrive_step,
            cache_salt=self.cache_salt,
            timeout_s=self.timeout_s,
            stop_at_ref_step=self.stop_at_ref_step,
            lora=self.lora_spec(),
            sent_schema=None if self.structured is None else self.structured.get("json"),
        )


# What an event waits for before it happens: a step count, or a request in a state.
EVENT_KINDS = ("abort", "preempt", "switch", "swap_fail")
ABORT_STATES = ("waiting", "prefill", "running", "swapped")
SWITCHES = ("prefix_caching", "namespace_caching", "preemption")


@dataclass(slots=True)
class EventScenario:
    kind: str  # one of EVENT_KINDS
    at_step: int = 0  # not before this step
    request_id: str | None = None  # abort, preempt: the request (sample 0) it targets
    state: str | None = None  # abort: the state the request must be in (ABORT_STATES)
    after_tokens: int = 0  # preempt: once the sample has this many output tokens
    resume_after_steps: int = 1  # preempt: steps it stays out
    mode: str | None = None  # preempt: recompute | swap | None (the engine's mode)
    switch: str | None = None  # switch: one of SWITCHES
    enabled: bool = False  # switch: the new setting
    cache_salt: str | None = None  # switch namespace_caching: the namespace
    count: int = 1  # swap_fail: swap writes that fail


@dataclass(slots=True)
class Scenario:
    name: str
    engine: dict  # EngineConfig overrides
    requests: list[RequestScenario]
    events: list[EventScenario] = field(default_factory=list)
    seed: int | None = None  # the generator's seed and index, to say where it came from
    index: int | None = None
    covers: dict = field(default_factory=dict)  # dimension -> the value(s) drawn for it
    # Exact cached tokens per request, where the scenario's construction determines them (an
    # eviction-order scenario runs alone in its pool, one request after the other).
    expect_hit_tokens: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Scenario:
        data = json.loads(text)
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        data["requests"] = [RequestScenario(**r) for r in data["requests"]]
        data["events"] = [EventScenario(**e) for e in data["events"]]
        return cls(**data)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, path: str | Path) -> Scenario:
        return cls.from_json(Path(path).read_text())

    @property
    def size(self) -> int:
        """What the shrinker makes smaller: tokens in and out, events, requests."""
        work = sum(len(r.prompt) + r.n * r.max_tokens for r in self.requests)
        plain = {"kv_cache_dtype": "auto", "max_num_batched_tokens": 2048}
        special = sum(self.engine.get(k, v) != v for k, v in plain.items())
        return work + 8 * len(self.events) + 4 * len(self.requests) + special


def to_case(scenario: Scenario, model=None) -> Case:
    """The scenario as a verification case, good for one run. An abort that found its request
    already finished expects nothing; one that happened expects the request to finish as
    aborted, so the expectation is written into this case when the abort is done. `model`:
    the model it runs on, to resolve `top_next` tokens (None: the drawn tokens stay)."""
    specs = [_resolved(r, model).spec() for r in scenario.requests]
    case = Case(SUITE, scenario.name, specs, dict(scenario.engine))
    case.expect_hit_tokens = dict(scenario.expect_hit_tokens)
    case.actions = [_action(e, case) for e in scenario.events]
    holds = [e.resume_after_steps for e in scenario.events if e.kind == "preempt"]
    case.hold_steps = sum(holds)
    for r in scenario.requests:
        if r.timeout_s is not None:
            case.expect_finish.setdefault(r.request_id, "timeout")
    return case


def _resolved(request: RequestScenario, model) -> RequestScenario:
    """`request` with its `top_next` token taken from the reference's logits (its own prefix,
    so the writer's logits there: the same tokens before it)."""
    if request.top_next is None or model is None:
        return request
    position, rank = request.top_next
    if not 0 < position < len(request.prompt):
        return request
    logits = reference_model(model).forward_full(request.prompt[:position])[-1].float()
    token = int(torch.topk(logits, rank + 1).indices[rank])
    prompt = list(request.prompt)
    prompt[position] = token
    return replace(request, prompt=prompt)


def _action(event: EventScenario, case: Case) -> Action:
    if event.kind == "abort":
        return _abort(event, case)
    if event.kind == "preempt":
        return Action(
            f"preempt {event.request_id} after {event.after_tokens} tokens",
            lambda d, s: s >= event.at_step,
            lambda d: d.force_preempt(
                event.request_id, event.after_tokens, event.resume_after_steps, event.mode
            ),
        )
    if event.kind == "switch":
        return Action(
            f"{event.switch} {'on' if event.enabled else 'off'} at step {event.at_step}",
            lambda d, s: s >= event.at_step,
            lambda d: _toggle(d, event),
        )
    if event.kind == "swap_fail":
        return Action(
            f"fail {event.count} swap write(s) from step {event.at_step}",
            lambda d, s: s >= event.at_step,
            lambda d: d.fail_swap_writes(event.count),
        )
    raise ValueError(f"unknown event kind {event.kind!r} (one of {EVENT_KINDS})")


def _abort(event: EventScenario, case: Case) -> Action:
    rid = event.request_id

    def due(driver: StepDriver, step: int) -> bool:
        return step >= event.at_step and _in_state(driver, rid, event.state)

    def do(driver: StepDriver) -> None:
        if driver.engine.abort_request(rid):
            case.expect_finish[rid] = "abort"

    return Action(f"abort {rid} while {event.state}", due, do)


def _in_state(driver: StepDriver, rid: str, state: str | None) -> bool:
    status = status_of(driver, rid)
    if status is None:
        return False
    if state is None or state == "running":
        return status is SeqStatus.RUNNING and (state is None or not _in_prefill(driver, rid))
    if state == "prefill":
        return status is SeqStatus.RUNNING and _in_prefill(driver, rid)
    return status is {"waiting": SeqStatus.WAITING, "swapped": SeqStatus.SWAPPED}[state]


def _in_prefill(driver: StepDriver, rid: str) -> bool:
    seq = driver.seqs[rid]
    return not seq.output_ids and seq.num_computed > 0


def _toggle(driver: StepDriver, event: EventScenario) -> None:
    if event.switch == "prefix_caching":
        driver.set_prefix_caching(event.enabled)
    elif event.switch == "namespace_caching":
        driver.set_namespace_caching(event.cache_salt, event.enabled)
    elif event.switch == "preemption":
        driver.engine.set_preemption(event.enabled)
    else:
        raise ValueError(f"unknown switch {event.switch!r} (one of {SWITCHES})")
