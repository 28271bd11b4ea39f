"""Generated scenarios: a seeded generator of whole scenarios (engine configuration, requests,
events), run as ordinary verification cases, shrunk to replayable JSON reproducers on failure."""

from kvpage.verify.generated.generator import Limits, generate
from kvpage.verify.generated.scenario import Scenario, to_case
from kvpage.verify.generated.stage import GeneratedResult, GeneratedStage, run_scenario, run_stage

__all__ = [
    "GeneratedResult",
    "GeneratedStage",
    "Limits",
    "Scenario",
    "generate",
    "run_scenario",
    "run_stage",
    "to_case",
]
