"""The one link from the audit to kvpage's own contiguous reference generator, for
`--reference-model DIR`: the checkpoint the server serves, run here greedily for each probe the
audit judged — one request alone, KV in plain per-layer tensors, no paging and no prefix cache.
It answers what the server *should* have said, so a bug that makes cold and warm answers wrong
alike is still caught."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.audit.completion import Completion, token_key
from kvpage.audit.errors import AuditUsageError
from kvpage.errors import KVPageError
from kvpage.model import load_model
from kvpage.reference.generator import generate
from kvpage.sampling_params import SamplingParams

TOP_K = 5


@dataclass(slots=True)
class Reference:
    model: object
    name: str
    dtype: str
    _memo: dict[tuple[tuple[int, ...], int, bool], Completion] = field(default_factory=dict)

    def answer(self, prompt_ids: tuple[int, ...], max_tokens: int, ignore_eos: bool) -> Completion:
        """Greedy tokens and top-k logprobs for the prompt, keyed `token_id:N` (memoised)."""
        key = (prompt_ids, max_tokens, ignore_eos)
        if key not in self._memo:
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=TOP_K
            )
            out = generate(self.model, list(prompt_ids), params)
            top = [{token_key(t): lp for t, lp in step.items()} for step in out.logprobs or []]
            pairs = zip(out.token_ids, top, strict=True)
            chosen = [step.get(token_key(t), float("nan")) for t, step in pairs]
            self._memo[key] = Completion(
                "",
                out.finish_reason,
                token_ids=list(out.token_ids),
                tokens=[token_key(t) for t in out.token_ids],
                logprobs=chosen,
                top=top,
            )
        return self._memo[key]


def load(directory: str, dtype: str = "float32") -> Reference:
    """Before any request: a reference that cannot load means a usage error (exit 2)."""
    try:
        model, _ = load_model(directory, dtype)
    except (KVPageError, OSError) as err:
        raise AuditUsageError(f"--reference-model {directory}: {err}") from err
    return Reference(model, directory, dtype)
