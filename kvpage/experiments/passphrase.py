"""The passphrase experiment: requests share a ~50-token instruction prefix
and differ in a secret; the model must answer with its own secret. Three sharing strategies:

  no_sharing     every request computes its own KV (prefix caching off)
  shared_no_cow  a new request joins a running request's blocks up to their common prefix,
                 the partial block included, without taking a reference or copying on write
  shared_cow     the same sharing, with refcount and copy-on-write

Per group: correct rate, contamination (whose secret leaked into whom), the ref_counts seen on
the shared blocks, and attention plots per head for one contaminated and one clean request."""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvpage.config import EngineConfig
from kvpage.engine.engine import LLMEngine
from kvpage.experiments.attention_capture import AttentionCapture
from kvpage.model import load_model
from kvpage.model import passphrase as task
from kvpage.sampling_params import SamplingParams
from kvpage.verify.mutants.sharing import share_running_prefix

STRATEGIES = ("no_sharing", "shared_no_cow", "shared_cow")
MODEL = "builtin:passphrase-mini"


@dataclass(slots=True)
class ExperimentConfig:
    runs: int = 100
    concurrency: int = 2
    block_size: int = 16
    num_blocks: int = 256
    max_model_len: int = 128
    strategies: tuple[str, ...] = STRATEGIES
    secrets: list[str] | None = None  # drawn from a seeded RNG when None
    seed: int = 0
    model: str = MODEL


@dataclass(slots=True)
class RequestResult:
    secret: str
    answer: str
    correct: bool
    leaked_from: int | None  # index (in its run) of the request whose secret it carries


@dataclass(slots=True)
class GroupResult:
    strategy: str
    runs: int = 0
    requests: int = 0
    correct: int = 0
    contaminated: int = 0
    leak_pairs: list[dict] = field(default_factory=list)
    shared_block_ref_counts: dict[str, int] = field(default_factory=dict)  # ref_count -> times
    examples: dict[str, dict] = field(default_factory=dict)  # "contaminated"/"clean" -> case

    @property
    def correct_rate(self) -> float:
        return self.correct / self.requests if self.requests else 0.0

    @property
    def contamination_rate(self) -> float:
        return self.contaminated / self.requests if self.requests else 0.0


def run_experiment(cfg: ExperimentConfig, out_dir: Path | None = None, progress=True) -> dict:
    model, tokenizer = load_model(cfg.model)
    secrets = _secret_schedule(cfg)
    groups = {}
    total = len(cfg.strategies) * cfg.runs
    done, start = 0, time.perf_counter()
    for strategy in cfg.strategies:
        group = GroupResult(strategy)
        for run in range(cfg.runs):
            _run_once(model, tokenizer, cfg, strategy, secrets[run], group, capture=out_dir)
            done += 1
            _progress(done, total, strategy, progress)
        groups[strategy] = group
    if progress:
        print(file=sys.stderr)
    results = _results_dict(cfg, groups, time.perf_counter() - start)
    if out_dir is not None:
        _write_outputs(results, groups, tokenizer, Path(out_dir))
    return results


def _secret_schedule(cfg: ExperimentConfig) -> list[list[str]]:
    rng = random.Random(cfg.seed)
    pool = list(cfg.secrets or [])
    runs = []
    for _ in range(cfg.runs):
        picked: list[str] = []
        while len(picked) < cfg.concurrency:  # distinct secrets within a run
            s = pool.pop(0) if pool else task.random_secret(rng)
            if s not in picked:
                picked.append(s)
        runs.append(picked)
    return runs


def _engine(model, tokenizer, cfg: ExperimentConfig, strategy: str) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=cfg.model,
            block_size=cfg.block_size,
            num_blocks=cfg.num_blocks,
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=False,
        ),
        model,
        tokenizer,
    )
    if strategy == "shared_no_cow":
        share_running_prefix(engine, refcount=False, cow=False)
    elif strategy == "shared_cow":
        share_running_prefix(engine, refcount=True, cow=True)
    elif strategy != "no_sharing":
        raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
    return engine


def _run_once(model, tokenizer, cfg, strategy, secrets, group: GroupResult, capture) -> None:
    """The first request prefills alone; the others arrive one step later, while it runs, so
    the sharing strategy can join its blocks."""
    engine = _engine(model, tokenizer, cfg, strategy)
    params = SamplingParams(max_tokens=task.MAX_SECRET_LEN + 2)
    attention = AttentionCapture(engine, watch="0") if capture is not None else None
    engine.add_request("0", task.prompt_ids(tokenizer, secrets[0]), params)
    outputs, step = {}, 0
    while engine.has_unfinished_requests() or step == 0:
        if step == 1:
            for i in range(1, len(secrets)):
                engine.add_request(str(i), task.prompt_ids(tokenizer, secrets[i]), params)
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        if step == 1:  # the joiners were admitted by this step
            _record_ref_counts(engine, group)
        step += 1
    results = [
        _judge(tokenizer, secrets, i, outputs[str(i)].outputs[0].token_ids)
        for i in range(len(secrets))
    ]
    _tally(group, results, secrets, attention)


def _record_ref_counts(engine: LLMEngine, group: GroupResult) -> None:
    """After the joiners were admitted: the ref_count of every block two tables point at."""
    tables = [s.table for s in engine.seqs.values() if s.table.block_ids]
    seen: dict[int, int] = {}
    for t in tables:
        for bid in t.block_ids:
            if bid >= 0:  # a window group 0 gave its NULL entries back (kvpage.cache.groups)
                seen[bid] = seen.get(bid, 0) + 1
    for bid, n_tables in seen.items():
        if n_tables > 1:
            key = str(engine.cache.pool.blocks[bid].ref_count - engine.cache.pool.blocks[bid].pins)
            group.shared_block_ref_counts[key] = group.shared_block_ref_counts.get(key, 0) + 1


def _judge(tokenizer, secrets: list[str], i: int, token_ids: list[int]) -> RequestResult:
    answer = task.parse_answer(tokenizer, token_ids)
    own = secrets[i]
    leaked = None
    if answer != own:
        scores = {j: _common_substring(answer, s) for j, s in enumerate(secrets) if j != i}
        best = max(scores, key=scores.get) if scores else None
        # Carrying another secret: a run of at least 4 of its characters (or all of a shorter
        # one), more of it than of its own secret.
        if (
            best is not None
            and scores[best] >= min(4, len(secrets[best]))
            and (scores[best] > _common_substring(answer, own))
        ):
            leaked = best
    return RequestResult(own, answer, answer == own, leaked)


def _common_substring(a: str, b: str) -> int:
    best = 0
    for i in range(len(a)):
        for j in range(i + best + 1, len(a) + 1):
            if a[i:j] in b:
                best = j - i
            else:
                break
    return best


def _tally(group: GroupResult, results: list[RequestResult], secrets, attention) -> None:
    group.runs += 1
    group.requests += len(results)
    for i, r in enumerate(results):
        group.correct += r.correct
        if r.leaked_from is not None:
            group.contaminated += 1
            group.leak_pairs.append(
                {
                    "run": group.runs - 1,
                    "victim": i,
                    "source": r.leaked_from,
                    "victim_secret": r.secret,
                    "answer": r.answer,
                    "source_secret": secrets[r.leaked_from],
                }
            )
    if attention is None:
        return
    watched = results[0]
    kind = (
        "contaminated"
        if watched.leaked_from is not None
        else ("clean" if watched.correct else None)
    )
    if kind and kind not in group.examples and attention.weights:
        group.examples[kind] = {
            "secrets": list(secrets),
            "answer": watched.answer,
            "weights": attention.weights,
        }


def _progress(done: int, total: int, label: str, enabled: bool) -> None:
    if not enabled:
        return
    width = 30
    bar = "#" * (width * done // total) + "." * (width - width * done // total)
    end = "" if sys.stderr.isatty() else "\n"
    if sys.stderr.isatty() or done == total or done % max(1, total // 10) == 0:
        print(f"\r[{bar}] {done}/{total} {label:<14}", end=end, file=sys.stderr, flush=True)


def _results_dict(cfg: ExperimentConfig, groups: dict[str, GroupResult], seconds: float) -> dict:
    config = asdict(cfg)
    config["strategies"] = list(cfg.strategies)
    return {
        "config": config,
        "seconds": round(seconds, 2),
        "groups": {
            name: {
                "runs": g.runs,
                "requests": g.requests,
                "correct": g.correct,
                "contaminated": g.contaminated,
                "correct_rate": g.correct_rate,
                "contamination_rate": g.contamination_rate,
                "shared_block_ref_counts": g.shared_block_ref_counts,
                "leak_pairs": g.leak_pairs,
            }
            for name, g in groups.items()
        },
    }


def _write_outputs(results: dict, groups: dict[str, GroupResult], tokenizer, out: Path) -> None:
    from kvpage.experiments.plots import plot_attention

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plots = []
    offset = task.secret_offset(tokenizer)
    for name, g in groups.items():
        for kind, example in g.examples.items():
            path = out / f"attention_{name}_{kind}.png"
            plot_attention(
                example["weights"],
                path,
                title=(
                    f"{name}, {kind} request: own secret {example['secrets'][0]!r}, answered "
                    f"{example['answer']!r}"
                ),
                secret_span=(offset, offset + len(example["secrets"][0])),
            )
            plots.append(path.name)
    (out / "report.md").write_text(_report_md(results, plots))


def _report_md(results: dict, plots: list[str]) -> str:
    cfg = results["config"]
    lines = [
        "# Passphrase experiment",
        "",
        f"{cfg['runs']} runs per group, {cfg['concurrency']} concurrent requests, block size "
        f"{cfg['block_size']}, {cfg['num_blocks']} blocks, model `{cfg['model']}`; "
        f"{results['seconds']}s.",
        "",
        "| group | runs | requests | correct | contaminated | correct rate | "
        "contamination rate | ref_counts on shared blocks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, g in results["groups"].items():
        lines.append(
            f"| {name} | {g['runs']} | {g['requests']} | {g['correct']} | "
            f"{g['contaminated']} | {g['correct_rate']:.1%} | "
            f"{g['contamination_rate']:.1%} | {g['shared_block_ref_counts'] or '-'} |"
        )
    lines += ["", "## Leaks (first 10 per group)", ""]
    for name, g in results["groups"].items():
        for leak in g["leak_pairs"][:10]:
            lines.append(
                f"- {name} run {leak['run']}: request {leak['victim']} (secret "
                f"`{leak['victim_secret']}`) answered `{leak['answer']}`, carrying request "
                f"{leak['source']}'s secret `{leak['source_secret']}`"
            )
    lines += ["", "## Attention of the watched request's answer steps, per layer and head", ""]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def load_secrets(path: str) -> list[str]:
    secrets = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    for s in secrets:
        task.check_secret(s)
    return secrets
