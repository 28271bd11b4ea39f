"""`kvpage verify`'s generated stage from the command line: a stage run reports what it ran and
covered, and a scenario file replays alone with an exit code that says whether it passed."""

from __future__ import annotations

import json

from kvpage.cli import main
from kvpage.verify.generated import generate
from kvpage.verify.generated.scenario import EventScenario, RequestScenario, Scenario


def test_a_generated_stage_reports_its_scenarios_and_coverage(tmp_path, capsys):
    args = ["verify", "--suite", "generated", "--generated", "3", "--seed", "5", "--no-mutants"]
    assert main([*args, "--quiet", "--report", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    generated = data["generated"]
    assert generated["seed"] == 5 and generated["scenarios"] == 3
    assert generated["failures"] == 0 and generated["stopped_by"] == "count"
    assert set(generated["coverage"]) >= {"block_size", "kv_cache_dtype", "preemption", "sampling"}
    assert "generated: 3 scenarios (seed 5" in capsys.readouterr().out
    assert "## Generated scenarios" in (tmp_path / "report.md").read_text()


def test_a_passing_scenario_replays_with_exit_0(tmp_path, capsys):
    path = generate(5, 0).write(tmp_path / "s.json")
    assert main(["verify", "--replay", str(path)]) == 0
    assert "passed" in capsys.readouterr().out


def test_a_failing_scenario_replays_with_exit_1(tmp_path, capsys):
    """A timeout the request can meet is not a timeout: the expectation fails, on any engine."""
    request = RequestScenario("quick", list(range(10, 20)), max_tokens=2, timeout_s=3600.0)
    path = Scenario("expects_a_timeout", {"block_size": 8}, [request]).write(tmp_path / "s.json")
    assert main(["verify", "--replay", str(path)]) == 1
    assert "finish_reason length, expected timeout" in capsys.readouterr().out


def test_a_file_that_is_not_a_scenario_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    assert main(["verify", "--replay", str(bad)]) == 2
    assert "--replay" in capsys.readouterr().err


def test_events_replay_as_written(tmp_path):
    scenario = generate(5, 1)
    scenario.events.append(EventScenario("swap_fail", 0, count=1))
    again = Scenario.read(scenario.write(tmp_path / "s.json"))
    assert again.events[-1] == EventScenario("swap_fail", 0, count=1)
