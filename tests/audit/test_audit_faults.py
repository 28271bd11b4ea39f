"""`kvpage serve --inject-fault`: refused without --allow-unsafe-faults, and when allowed, a real
`kvpage serve` process that marks every reply and that `kvpage audit` fails through the API; a
fault on the swap path brings its trigger, which swaps every request and alone changes nothing."""

from __future__ import annotations

import sys

import httpx

from kvpage import LLM, SamplingParams
from kvpage.audit.faults import FAULT_HEADER, SWAP_TRIGGERED, find, swap_each_request_once
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
