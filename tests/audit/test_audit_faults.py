"""`kvpage serve --inject-fault`: refused without --allow-unsafe-faults, and when allowed, a real
`kvpage serve` process that marks every reply and that `kvpage audit` fails through the API; a
fault on the swap path brings its trigger, which swaps every request and alone changes nothing;
a fault that frees a block still held brings one that overwrites every freed block, which alone
changes nothing and makes the fault show whatever the timing."""

from __future__ import annotations

import sys

import httpx
import pytest

from kvpage import LLM, SamplingParams
from kvpage.audit.faults import (
    FAULT_HEADER,
    REUSE_TRIGGERED,
    SWAP_TRIGGERED,
    find,
    overwrite_freed_blocks,
    swap_each_request_once,
)
from kvpage.cli import main
from kvpage.server.background import free_port
from tests.audit.servers import MODEL
from tests.waiting import READY_S, LoggedProcess, answers


def test_faults_are_refused_unless_allowed(capsys):
    assert main(["serve", "--inject-fault", "no_refcount"]) == 2
    assert "--allow-unsafe-faults" in capsys.readouterr().err
    assert main(["serve", "--inject-fault", "nope", "--allow-unsafe-faults"]) == 2
    assert "no fault named 'nope'" in capsys.readouterr().err


def test_a_served_fault_is_marked_and_caught_by_the_audit(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvpage.cli", "serve", "--port", str(port), "--shadow-rate", "0"]
    cmd += ["--audit-log", str(tmp_path / "audit.jsonl")]
    cmd += ["--inject-fault", "off_by_one_block_boundary", "--allow-unsafe-faults"]
    proc = LoggedProcess(cmd, tmp_path / "serve.log")
    try:
        proc.wait_for(answers(f"{url}/health"), "/health answering 200")
        health = httpx.get(f"{url}/health", timeout=READY_S)
        assert health.headers[FAULT_HEADER] == "off_by_one_block_boundary"
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=READY_S) as r:
            assert r.headers[FAULT_HEADER] == "off_by_one_block_boundary"
        report = tmp_path / "report"
        args = ["audit", "--base-url", url, "--model", MODEL, "--quiet", "--report", str(report)]
        args += ["--block-sizes", "16", "--probes", "2", "--suites", "baseline,batch,prefix"]
        assert main(args) == 1
        assert "prefix: isolation failure" in (report / "report.md").read_text()
        proc.stop()
    finally:
        proc.kill()
    assert "WARNING: fault 'off_by_one_block_boundary' injected" in proc.log(lines=10**6)


def test_the_swap_trigger_swaps_every_request_and_alone_changes_no_token():
    """What makes a swap-path fault show whatever the timing: every request is swapped out and
    back in. On an honest engine it is invisible, so an audit that fails a triggered fault
    fails the bug, not the trigger."""
    prompts = [list(range(10 + i, 40 + 3 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain, swapping = (LLM(MODEL, num_blocks=24, preemption_mode="swap") for _ in range(2))
    swap_each_request_once(swapping.engine)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in swapping.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = swapping.engine.stats()
    assert stats["swap_outs"] == stats["swap_ins"] == len(prompts)
    assert all(find(name) for name in SWAP_TRIGGERED)  # each names a fault that exists


def _sharing_run(preemption: str, trigger: bool, fault: str | None = None) -> list[list[int]]:
    """Requests sharing a 40-token prefix, decoding together on a pool tight enough to preempt
    and reuse blocks; the freed-block trigger planted first when asked."""
    prefix = list(range(100, 140))
    prompts = [prefix + list(range(10 + 7 * i, 14 + 7 * i)) for i in range(6)]
    params = [SamplingParams(max_tokens=4 + 6 * (i % 3), ignore_eos=True) for i in range(6)]
    llm = LLM(MODEL, num_blocks=24, preemption_mode=preemption)
    if fault is not None:
        find(fault).apply(llm.engine)
    if trigger:
        overwrite_freed_blocks(llm.engine)
    llm.generate([prompts[0]], params[0], use_tqdm=False)  # its prefix cached
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_the_freed_block_trigger_alone_changes_no_token(preemption):
    """An honest engine never reads a freed block: overwriting each as it is freed (in order
    with the step's swap-outs and copies) leaves every token as it was."""
    assert _sharing_run(preemption, True) == _sharing_run(preemption, False)
    assert all(find(name) for name in REUSE_TRIGGERED)  # each names a fault that exists


def test_the_freed_block_trigger_makes_no_refcount_show():
    """no_refcount frees the shared prefix for everyone when the first sharer finishes; with
    the trigger the others then read overwritten K/V, whatever the timing."""
    honest = _sharing_run("recompute", False)
    assert _sharing_run("recompute", True, "no_refcount") != honest
