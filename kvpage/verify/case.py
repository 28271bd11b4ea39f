"""What a verification case is: requests with arrival steps and expectations, and actions done to
the engine between steps. Case builders live in kvpage.verify.cases, one module per suite."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpage.sampling_params import SamplingParams
from kvpage.verify.canary import make_canaries
from kvpage.verify.driver import StepDriver
from kvpage.verify.lora_adapters import LoraSpec


@dataclass(slots=True)
class RequestSpec:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrive_step: int = 0  # engine steps run before this request is added
    cache_salt: str | None = None
    timeout_s: float | None = None
    canary: tuple[int, ...] = ()
    # Stop on the token the reference draws at this step (resolved against the reference before
    # the case runs), so a stop rule is exercised whatever the model's weights are.
    stop_at_ref_step: int | None = None
    lora: LoraSpec | None = None  # the adapter it runs with (kvpage.verify.lora_adapters)
    # Its JSON schema as the case wrote it: the checker validates the output against this, not
    # against StructuredOutputsParams' normalized text (a bug there would be in both)
    sent_schema: dict | None = None
    # (request id, n): its prompt is that request's prompt followed by the first n tokens the
    # reference decodes for it (resolved before the case runs, like stop_at_ref_step), so it
    # can hit blocks that request's own output filled
    continues: tuple[str, int] | None = None

    def sample_ids(self) -> list[str]:
        """Trace keys of the request's samples (kvpage.engine.sequence.Sequence.sample_id)."""
        n = self.params.n
        return [self.request_id] if n == 1 else [f"{self.request_id}#{i}" for i in range(n)]


@dataclass(slots=True)
class Action:
    """Something done between steps, once `when(driver, step)` holds: through the test driver
    (kvpage.verify.driver), which reaches the engine only by its public calls."""

    name: str
    when: Callable[[StepDriver, int], bool]
    do: Callable[[StepDriver], None]


@dataclass(slots=True)
class Case:
    suite: str
    name: str
    requests: list[RequestSpec]
    engine: dict = field(default_factory=dict)  # EngineConfig overrides
    actions: list[Action] = field(default_factory=list)
    expect_finish: dict[str, str] = field(default_factory=dict)  # request -> finish reason
    expect_hit: tuple[str, ...] = ()  # requests that must be served from the prefix cache
    expect_no_hit: tuple[str, ...] = ()  # requests that must not be (another namespace)
    expect_preemption: bool = False
    expect_counters: dict[str, int] = field(default_factory=dict)  # exact stats at the end
    expect_hit_tokens: dict[str, int] = field(default_factory=dict)  # exact cached tokens
    check_sampling: bool = False  # also test the case's draws against the sampling oracle
    hold_steps: int = 0  # steps its forced preemptions keep requests out (for the step bound)

    @property
    def full_name(self) -> str:
        return f"{self.suite}/{self.name}"


class Tokens:
    """Deterministic token material, avoiding special ids."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ids = list(range(3, min(vocab, 256)))

    def take(self, n: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def with_canaries(specs: list[RequestSpec], vocab: int, seed: int) -> list[RequestSpec]:
    """Put each request's canary at the end of its private tail (keeps shared prefixes intact)."""
    ids = list(range(3, min(vocab, 256)))
    canaries = make_canaries([s.request_id for s in specs], ids, seed)
    for s in specs:
        s.canary = canaries[s.request_id]
        s.prompt = s.prompt + list(s.canary)
    return specs


def preempting_engine(
    mode: str, block_size: int, num_blocks: int, swap_space_blocks: int = 64, **more
) -> dict:
    """The engine of a case that preempts in `mode`: a pool of `num_blocks` blocks (tiny, so
    freed blocks are reused at once) and swap space for the swapped ones."""
    return dict(
        block_size=block_size,
        num_blocks=num_blocks,
        preemption_mode=mode,
        swap_space_blocks=swap_space_blocks,
        **more,
    )


def forced_preemption_case(
    suite: str,
    name: str,
    specs: list[RequestSpec],
    actions: list[Action],
    mode: str,
    pool: tuple[int, int],
    hold_steps: int,
    **expect,
) -> Case:
    """A case whose `actions` force preemptions in `mode` on a pool of (block size, blocks)
    (preempting_engine): it must see one, and its step bound allows `hold_steps` steps out."""
    return Case(
        suite,
        name,
        specs,
        preempting_engine(mode, *pool),
        actions=actions,
        expect_preemption=True,
        hold_steps=hold_steps,
        **expect,
    )


def after_one_preemption(mode: str) -> dict[str, int]:
    """The swap counters once one forced preemption has resumed: swapped back in once, or
    (recompute) nothing ever swapped out."""
    return {"swap_ins": 1} if mode == "swap" else {"swap_outs": 0}


def preempt_once_added(
    name: str,
    rid: str,
    after_tokens: int,
    resume_after_steps: int,
    mode: str | None,
    sample: str | None = None,
) -> Action:
    """As soon as request `rid` is in the engine, force-preempt `sample` (default: `rid`, its
    sample 0) after its `after_tokens`-th token, to resume `resume_after_steps` steps later."""
    target = rid if sample is None else sample
    return Action(
        name,
        lambda e, s: rid in e.seqs,
        lambda e: e.force_preempt(target, after_tokens, resume_after_steps, mode),
    )


def preempt_at_step(
    name: str,
    step: int,
    sample: str,
    after_tokens: int,
    resume_after_steps: int,
    mode: str | None = None,
) -> Action:
    """Before step `step`, force-preempt `sample` after its `after_tokens`-th token, to resume
    `resume_after_steps` steps later."""
    return Action(
        name,
        lambda e, s: s == step,
        lambda e: e.force_preempt(sample, after_tokens, resume_after_steps, mode),
    )


def status_of(driver: StepDriver, rid: str):
    seq = driver.seqs.get(rid)
    return None if seq is None else seq.status
