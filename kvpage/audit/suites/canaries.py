"""Canaries: requests sent together, each carrying a marker only it has (a short token-id run, or
a random string in text mode). A marker seen in another request's output — or, in text mode, its
top-k — that its solo run did not show is an isolation failure attributed to the pair. One group
shares nothing, one shares a prefix that ends inside a block for every candidate block size."""

from __future__ import annotations

from kvpage.audit.completion import Completion
from kvpage.audit.probes import Canary, Prompt
from kvpage.audit.suites.base import UNTESTABLE, SuiteContext, SuiteResult

NAME = "canaries"
MIN_RUN = 2  # canary ids in a row that count as the canary (one id alone is chance)
MIN_CHARS = 4  # canary characters in a row that count, in text mode
MIN_TOP_CHARS = 3  # a top-k token string this long inside a foreign canary counts


def run(ctx: SuiteContext) -> SuiteResult:
    result = ctx.start(NAME, UNTESTABLE)
    if ctx.factory.mode == "ids" and ctx.caps.token_ids_field is None:
        result.untested.append(
            "token-id prompts but no output token ids: a canary cannot be recognised in output"
        )
        return result
    shared = max(ctx.cfg.block_sizes) + min(ctx.cfg.block_sizes) // 2
    for group, prefix_len in (("g0", 0), ("g1", shared)):
        prefix = ctx.factory.random(prefix_len)
        ctx.attempt(
            result, group, lambda g=group, p=prefix, n=prefix_len: _group(ctx, result, g, p, n)
        )
    result.verdict = result.judged_verdict()
    leaks = [c for c in result.checks if c.pair]
    result.summary = (
        f"{len(result.checks)} requests in groups of {ctx.cfg.canary_group}; "
        f"{len(leaks)} foreign canary sighting(s); {len(result.divergences)} diverged"
    )
    return result


def _group(ctx: SuiteContext, result: SuiteResult, group: str, prefix: Prompt, shared: int) -> None:
    n = ctx.cfg.canary_group
    canaries = [ctx.factory.canary(f"{group}/r{i}") for i in range(n)]
    prompts = [
        prefix + c.prompt + ctx.factory.random(3 + 5 * i) + c.prompt for i, c in enumerate(canaries)
    ]
    tokens = [ctx.cfg.max_tokens + 4 * (i % 3) for i in range(n)]
    calls = [
        lambda p=p, t=t: ctx.session.complete(p, t) for p, t in zip(prompts, tokens, strict=True)
    ]
    outs = ctx.session.concurrently(calls)
    refs = [
        ctx.session.complete(p, t, tenant=ctx.cold()) for p, t in zip(prompts, tokens, strict=True)
    ]
    for i, (canary, ref, out) in enumerate(zip(canaries, refs, outs, strict=True)):
        foreign = [c for j, c in enumerate(canaries) if j != i]
        seen = next((c for c in foreign if _sighting(c, ref, out)), None)
        context = {
            "mode": f"{n} concurrent, canary each",
            "shared_tokens": shared,
            "canary": _show(canary),
        }
        label = f"{_show(seen)} of {seen.owner}" if seen else None
        pair = (seen.owner, canary.owner) if seen else None
        result.checks.append(ctx.judge(NAME, canary.owner, ref, out, context, label, pair))


def _show(canary: Canary | None) -> str:
    if canary is None:
        return ""
    return canary.text if canary.text is not None else ",".join(map(str, canary.ids or ()))


def _sighting(canary: Canary, ref: Completion, out: Completion) -> bool:
    """The canary in `out` but not in `ref` (what the solo run shows is the model's own)."""
    if canary.ids is not None:
        runs = _id_runs(canary.ids)
        return any(
            _contains(out.token_ids or [], r) and not _contains(ref.token_ids or [], r)
            for r in runs
        )
    text = canary.text or ""
    pieces = {text[i : i + MIN_CHARS] for i in range(len(text) - MIN_CHARS + 1)}
    if any(p in out.text and p not in ref.text for p in pieces):
        return True
    return _in_top(text, ref, out)


def _in_top(text: str, ref: Completion, out: Completion) -> bool:
    for i, top in enumerate(out.top or []):
        solo = set(ref.top[i]) if ref.top and i < len(ref.top) else set()
        for token in top:
            piece = token.strip()
            if len(piece) >= MIN_TOP_CHARS and piece in text and token not in solo:
                return True
    return False


def _id_runs(ids: tuple[int, ...]) -> list[list[int]]:
    return [list(ids[i : i + MIN_RUN]) for i in range(len(ids) - MIN_RUN + 1)]


def _contains(seq: list[int], run: list[int]) -> bool:
    n = len(run)
    return any(seq[i : i + n] == run for i in range(len(seq) - n + 1))
