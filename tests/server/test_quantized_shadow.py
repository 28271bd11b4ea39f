"""Shadow comparison on a quantized server: the recomputation rounds K/V as the
served pool does, so a correct int8 server counts no pollution -- and a real difference still does."""

from __future__ import annotations

from kvpage import LLM, SamplingParams
from kvpage.server import ServerOptions, create_app
from kvpage.server.audit import AuditLog
from kvpage.server.shadow import ShadowChecker, ShadowJob

MODEL = "builtin:tiny-llama"


def test_shadow_of_an_int8_server_uses_the_int8_reference():
    llm = LLM(MODEL, kv_cache_dtype="int8", num_blocks=64)
    app = create_app(llm.engine, ServerOptions(model_name=MODEL, shadow_rate=1.0))
    checker = app.state.server.shadow
    assert checker.kv_cache_dtype == "int8"
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = [256, *b"a prompt long enough to be worth a cache hit"]
    served = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert checker.check(ShadowJob("ok", prompt, params, served, 32)) is None
    changed = [*served[:5], (served[5] + 1) % 256, *served[6:]]
    assert checker.check(ShadowJob("bad", prompt, params, changed, 32)) == 5
    assert ShadowChecker(llm.engine.model, AuditLog(sample_rate=0.0), 1.0).kv_cache_dtype == "auto"
