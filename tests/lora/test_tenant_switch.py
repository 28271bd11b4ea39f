"""A tenant's kill switch covers the tenant's adapter requests too: each adapter keys its own
namespace under the salt, and while the salt is off none of them hits or publishes (a
generated scenario found adapter requests of a switched-off tenant still hitting)."""

from __future__ import annotations

from kvpage import LLM, LoRARequest, SamplingParams
from kvpage.verify.cases.lora import QV, A
from kvpage.verify.lora_adapters import write_peft

PROMPT = list(range(20, 20 + 48))  # three 16-token blocks
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def _cached(llm, salt, lora) -> int:
    [out] = llm.generate([PROMPT], PARAMS, cache_salt=salt, lora_request=lora)
    return out.metrics.num_cached_tokens


def test_a_switched_off_tenant_gets_no_hit_with_any_adapter(tmp_path):
    llm = LLM("builtin:tiny-llama", enable_lora=True, max_lora_rank=8, enable_prefix_caching=True)
    cfg = llm.engine.model.config
    a = LoRARequest("a", write_peft(A, cfg, tmp_path / "a").path)
    qv = LoRARequest("qv", write_peft(QV, cfg, tmp_path / "qv").path)
    engine = llm.engine
    assert _cached(llm, "t", a) == 0 and _cached(llm, "t", a) > 0  # warm, then a hit
    engine.set_namespace_caching("t", False)
    assert _cached(llm, "t", a) == 0  # an adapter namespace seen before the switch
    assert _cached(llm, "t", qv) == 0 and _cached(llm, "t", qv) == 0  # first seen while off
    assert _cached(llm, "u", a) == 0 and _cached(llm, "u", a) > 0  # another tenant: untouched
    engine.set_namespace_caching("t", True)
    assert _cached(llm, "t", a) > 0  # its blocks were kept, and hit again
    assert _cached(llm, "t", qv) == 0  # nothing was published while off
