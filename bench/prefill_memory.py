"""kvpage with freed memory kept in the heap (kvpage.host_memory) against glibc's defaults, each
setting in its own process (the setting is process-wide), interleaved round by round:

    python bench/prefill_memory.py [--workloads prefix,batched] [--rounds 3] [--threads 2]
                                   [--dtype float32|bfloat16]

Each round starts one process per setting that builds the engine of bench/throughput.py's solo
mode on its 125M model (`kvpage_llm`: warmed up, untimed) and runs each workload of
bench/solo.py once, as the solo bench does. Prints per setting and workload the wall time of
the generate call (min and median over rounds) and the minor page faults during it, then the
default/kept ratio."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SETTINGS = {"kept": "1", "default": "0"}


def child(model_dir: str, workloads: list[str], dtype: str, threads: int) -> None:
    import solo
    import torch
    from throughput import blocks_needed, kvpage_llm

    from kvpage import SamplingParams

    torch.set_num_threads(threads)
    chosen = solo.make_workloads(workloads, 32000, 0, False)
    llm = kvpage_llm(model_dir, max(blocks_needed(w) for w in chosen), True, 0, dtype)
    results = {}
    for wl in chosen:
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        llm.generate(wl.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        results[wl.name] = {"wall": wall, "faults": faults}
    llm.close()
    print(json.dumps(results))


def run_child(keep: str, argv: list[str]) -> dict:
    env = {**os.environ, "KVPAGE_KEEP_FREED_MEMORY": keep}
    cmd = [sys.executable, __file__, "--child", *argv]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="prefix,batched")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = args.workloads.split(",")
    if args.child:
        return child(args.child, names, args.dtype, args.threads)
    from throughput import build_model

    with tempfile.TemporaryDirectory() as model_dir:
        build_model("125m", 2048, model_dir)
        argv = [model_dir, f"--workloads={args.workloads}", f"--dtype={args.dtype}",
                f"--threads={args.threads}"]  # fmt: skip
        runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
        for r in range(args.rounds):
            order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
            for name in order:
                runs[name].append(run_child(SETTINGS[name], argv))
    print(f"{args.dtype}, {args.threads} threads, {args.rounds} rounds, one process per run")
    print(f"{'workload':10s} {'setting':8s} {'wall s min (med)':>18s} {'page faults (med)':>18s}")
    for wl in names:
        walls = {}
        for name, rs in runs.items():
            w = [r[wl]["wall"] for r in rs]
            walls[name] = (min(w), statistics.median(w))
            faults = statistics.median(r[wl]["faults"] for r in rs)
            print(f"{wl:10s} {name:8s} {min(w):9.3f} ({statistics.median(w):.3f}) {faults:18.0f}")
        (kb, km), (db, dm) = walls["kept"], walls["default"]
        print(f"{wl:10s} default/kept wall: {db / kb:.2f}x ({dm / km:.2f}x)")


if __name__ == "__main__":
    main()
