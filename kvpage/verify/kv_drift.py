"""How far a quantized KV format moves a model from unquantized KV: measured on the
gate's prompts, not assumed. The paged engine must equal the *quantized* reference exactly; this is
the other question -- what the quantization itself costs.

For each prompt the unquantized reference generates greedily; then the prompt plus those tokens go
once through the model with the K/V round trip of the format (teacher forcing), so every position
is judged on the same context: greedy agreement = positions whose argmax is the unquantized token,
max logit error = the largest |logit difference| at any of them. A request agrees wholly when no
position differs (its free-running quantized output is then identical)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.model.base import CausalLM
from kvpage.reference.generator import generate
from kvpage.reference.kv_oracle import RoundTrip, RoundTripKVCache
from kvpage.sampling_params import SamplingParams

DRIFT_SUITES = ("prefix", "batching", "preemption")


@dataclass(slots=True)
class DriftReport:
    kv_cache_dtype: str
    requests: int = 0
    tokens: int = 0
    agreeing_tokens: int = 0
    identical_requests: int = 0
    max_logit_error: float = 0.0
    errors: list[float] = field(default_factory=list)  # per request, its max logit error
    weights: str = "none"  # the quantized model's weights (kvpage.verify.weight_drift)

    def add(self, quantized: torch.Tensor, expected: torch.Tensor, tokens: list[int]) -> None:
        """One request: its teacher-forced quantized logits (n, V) against the unquantized
        ones (n, V) and the unquantized greedy tokens (n)."""
        agree = quantized.argmax(dim=-1) == torch.tensor(tokens)
        error = float((quantized - expected).abs().max())
        self.requests += 1
        self.tokens += agree.numel()
        self.agreeing_tokens += int(agree.sum())
        self.identical_requests += bool(agree.all())
        self.max_logit_error = max(self.max_logit_error, error)
        self.errors.append(error)

    @property
    def agreement(self) -> float:
        return self.agreeing_tokens / self.tokens if self.tokens else 1.0

    def summary(self) -> dict:
        return {
            "kv_cache_dtype": self.kv_cache_dtype,
            "weights": self.weights,
            "requests": self.requests,
            "tokens": self.tokens,
            "greedy_agreement": round(self.agreement, 4),
            "identical_requests": self.identical_requests,
            "max_logit_error": round(self.max_logit_error, 4),
        }


def gate_prompts(vocab: int, suites: tuple[str, ...] = DRIFT_SUITES) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) of every greedy request of the gate's suites, each once."""
    from kvpage.verify.cases import build_suites  # the case builders, not the engine

    seen: dict[tuple[int, ...], int] = {}
    for case in build_suites(vocab, suites):
        for spec in case.requests:
            if spec.params.greedy and spec.params.n == 1:
                seen.setdefault(tuple(spec.prompt), spec.params.max_tokens)
    return [(list(p), n) for p, n in seen.items()]


@torch.inference_mode()
def measure_drift(
    model: CausalLM, kv_cache_dtypes: tuple[str, ...], prompts: list[tuple[list[int], int]]
) -> dict[str, DriftReport]:
    """One DriftReport per KV dtype; the unquantized reference runs once per prompt."""
    reports = {d: DriftReport(d) for d in kv_cache_dtypes}
    for prompt, max_tokens in prompts:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        plain = generate(model, prompt, params)
        expected = torch.stack(plain.step_logits)  # (n, V)
        for kv_cache_dtype, report in reports.items():
            quantized = _teacher_forced(model, prompt, plain.token_ids, kv_cache_dtype)  # (n, V)
            report.add(quantized, expected, plain.token_ids)
    return reports


def _teacher_forced(model: CausalLM, prompt: list[int], tokens: list[int], kv_cache_dtype: str):
    """Logits (len(tokens), V) predicting each of `tokens` after the prompt, K/V round-tripped."""
    ids = prompt + tokens[:-1]
    cache = RoundTripKVCache(model.config.num_layers, RoundTrip(kv_cache_dtype))
    ids_t = torch.tensor(ids, dtype=torch.long, device=model.device)
    hidden = model(ids_t, torch.arange(len(ids), device=model.device), cache)  # (T, C)
    return model.compute_logits(hidden[len(prompt) - 1 :]).float().cpu()
