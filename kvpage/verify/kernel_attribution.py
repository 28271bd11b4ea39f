"""The kernel class: a divergence that only the engine's fast paths show. The reference runs
on torch's kernels alone (kvpage.model.kernels); when a case diverges, it runs again with the
engine's model bound with every fast path off too (EngineConfig.fast_paths_off). A case that then passes has its divergences attributed
to `kernel`, naming the one path with which alone turned off it passes too (the decode tape
first: it runs only with every path on, so a bug in a kernel it calls is named by the kernel's
own run). Cache, scheduling and sampling bugs do not depend on the kernels: their re-run fails
the same, and their class stands.

Only under tensor parallelism 1: the ranks of a split model are other processes, bound there."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

from kvpage.model.kernels import FAST_PATHS
from kvpage.verify.checks import Failure
from kvpage.verify.diff import REQUIRED_FIELDS, Attribution

# Classes that already say why a divergence is specific to one configuration of the engine.
EXPLAINED = ("quantized_kv",)


def attribute_kernels(case, runtime, failures: list[Failure], run: Callable) -> None:
    """Re-attribute `failures`' divergences to `kernel` when the case passes with the engine's
    fast paths off. `run(case, runtime)` runs the case (kvpage.verify.suites.run_case)."""
    diverged = [f for f in failures if f.divergence is not None]
    if not diverged or runtime.tensor_parallel_size != 1:
        return  # nothing to explain, or other processes
    if not runtime.kernel_reruns or runtime.engine_overrides.get("fast_paths_off"):
        return  # a re-run itself, or a run with some paths off already
    if any(f.divergence.attribution.cls in EXPLAINED for f in diverged):
        return
    if not run(case, with_paths_off(runtime, FAST_PATHS)).passed:
        return  # the kernels do not make the difference
    named = [path for path in _one_path_that_fixes(case, runtime, run)]
    for f in diverged:
        f.divergence.attribution = _kernel_attribution(f.divergence.attribution, named, case)


def with_paths_off(runtime, paths: Iterable[str]):
    """A copy of `runtime` whose engines bind their model without `paths` (and attribute
    nothing again); the references are shared."""
    rerun = copy.copy(runtime)
    rerun.engine_overrides = {**runtime.engine_overrides, "fast_paths_off": tuple(paths)}
    rerun.kernel_reruns = False
    return rerun


def _one_path_that_fixes(case, runtime, run: Callable) -> list[str]:
    for path in FAST_PATHS:
        if run(case, with_paths_off(runtime, (path,))).passed:
            return [path]
    return []


def _kernel_attribution(was: Attribution, named: list[str], case) -> Attribution:
    paths = named or list(FAST_PATHS)
    alone = f"with {named[0]} alone off" if named else "only with every fast path off"
    reason = (
        f"the case passes {alone} (the engine on torch's kernels otherwise): a fast path's "
        f"result differs from torch's; before the re-run it read as {was.cls}: {was.reason}"
    )
    fields = {
        "paths": paths,
        "passes_without": alone,
        "case": case.full_name,
        "class_before": was.cls,
        "fields_before": was.fields,
    }
    missing = [f for f in REQUIRED_FIELDS["kernel"] if fields.get(f) is None]
    return Attribution("kernel", reason, fields, missing)
