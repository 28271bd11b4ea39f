"""The logit tolerance's measured factors (kvpage/verify/diff.py, the comment above
UNIT_ROUNDOFF): r = drift / (u * max |logit| of the step) over every step pair the gate's suites
compare, with the tolerance lifted so that no comparison stops early. Prints the largest r and
the drift it came from; the factor in diff.py is 2-3x the worst r of its kind.

    .venv/bin/python bench/tolerance_factors.py --model builtin:tiny-llama --dtype bfloat16 \
        --suite lora [--kv-cache-dtype int8]
"""

from __future__ import annotations

import argparse

import kvpage.verify.diff as diff
from kvpage.verify.gate import run_gate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--suite", default="lora")
    args = parser.parse_args()
    ratios: list[tuple[float, float, float]] = []  # (r, drift, scale)
    original = diff._max_abs

    def recording(ref, cand):
        drift = original(ref, cand)
        if drift is not None:
            scale = max(1.0, float(ref.logits.abs().max()))
            u = diff.UNIT_ROUNDOFF[_dtype(args.dtype)]
            ratios.append((drift / (u * scale), drift, scale))
        return drift

    diff._max_abs = recording
    diff.HALF_PRECISION_FACTOR = diff.FULL_PRECISION_FACTOR = 1e6  # no comparison stops early
    engine = {"kv_cache_dtype": args.kv_cache_dtype, "dtype": args.dtype}
    result = run_gate(args.model, tuple(args.suite.split(",")), mutants=False, progress=False,
                      kv_cache_dtypes=(), engine=engine)  # fmt: skip
    worst = max(ratios, default=(0.0, 0.0, 0.0))
    print(
        f"{args.model} {args.dtype} kv={args.kv_cache_dtype} suites={args.suite}: "
        f"{len(ratios)} step pairs, worst r = {worst[0]:.2f} (drift {worst[1]:.3g} at "
        f"|logit| {worst[2]:.3g}); cases passed {sum(c.passed for c in result.cases)}/"
        f"{len(result.cases)}"
    )


def _dtype(name: str):
    import torch

    return getattr(torch, name)


if __name__ == "__main__":
    main()
