"""Which kernel each op of a model runs, chosen once: `finalize(model, kernels=...)` after load ->
quantize -> shard -> LoRA attach gives every op its kernel object (a linear layer its weight
GEMV / AMX / oneDNN-packed / widened / int8 GEMV / torch kernels, a norm, the rotary embedding
and silu * up native or torch's) by the weights' shape and dtype and the CPU. The layers then
call what they were given: no per-call switch, no per-call check of the weights.

Why once: choosing per call cost a dozen attribute reads and every weight's pointer and version
counter per linear layer, and made the decode fast path re-check itself against the modules on
every step. The price: whatever changes weights after finalize (an in-place edit, a `.to()`,
replaced parameters) calls `finalize` again.

The fast paths by the names the gate's reports give them (`FAST_PATHS`); `finalize(model,
kernels=("gemv",))` binds the model with those off (EngineConfig.fast_paths_off: the gate's
`paths_off` cells and its kernel re-runs). The environment adds its own: KVPAGE_NATIVE=0 turns
every native kernel off, KVPAGE_DECODE_PLAN=0 the decode tape, KVPAGE_AMX=0 the AMX kernel.

The verifier's reference runs `torch_twin(model)`: a copy of the model sharing its weight
tensors, bound to torch's operators only, so a bug in a fast path is never on both sides of the
gate's comparison."""

from __future__ import annotations

import copy
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from kvpage.errors import InvalidConfig
from kvpage.model.linear_kernels import LINEAR_PATHS

# Each fast path by the name the gate's reports give it.
FAST_PATHS = (
    "decode_plan",  # kvpage.model.decode_tape: the module forward's kernel calls, replayed
    # The linear kernels (kvpage.model.linear_kernels): the weight GEMV at a few rows (int8
    # ones too), bfloat16 at 3-32 rows on AMX tiles, oneDNN's prepacked weights, int8 and
    # bfloat16 weights widened a tile at a time.
    *LINEAR_PATHS,
    "small_ops",  # kvpage.model.native_small_ops: RMSNorm, rotary, silu * up
    "paged_decode",  # kvpage.model.native_attention: the paged decode attention kernel
)
# What KVPAGE_NATIVE=0 turns off: every path of kvpage's own kernels (oneDNN and the widened
# tiles are torch's).
NATIVE_PATHS = tuple(p for p in FAST_PATHS if p not in ("onednn", "widened"))
# An environment variable set to "0" turns these paths off in every finalize.
ENV_OFF = {
    "KVPAGE_NATIVE": NATIVE_PATHS,
    "KVPAGE_DECODE_PLAN": ("decode_plan",),
    "KVPAGE_AMX": ("amx",),
}


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The fast paths a model is bound without (the rest: where its weights and CPU allow)."""

    off: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.off) - set(FAST_PATHS)
        if unknown:
            raise InvalidConfig(f"unknown fast paths {sorted(unknown)}; known: {FAST_PATHS}")

    def on(self, path: str) -> bool:
        return path not in self.off

    @property
    def all_on(self) -> bool:
        return not self.off


TORCH = KernelChoice(frozenset(FAST_PATHS))  # torch's operators only: the reference's


def kernel_choice(off: Iterable[str] = ()) -> KernelChoice:
    """`off` and what the environment turns off (ENV_OFF)."""
    from_env = [p for name, paths in ENV_OFF.items() if os.environ.get(name) == "0" for p in paths]
    return KernelChoice(frozenset((*off, *from_env)))


def finalize(model: nn.Module, kernels: KernelChoice | Iterable[str] = ()) -> nn.Module:
    """Bind every op of `model` to its kernel: `kernels` a KernelChoice, or the fast paths to
    keep off (with the environment's, kernel_choice). Children are bound before their parents
    (a model's decode tape records its layers' bound kernels). Returns `model`."""
    choice = kernels if isinstance(kernels, KernelChoice) else kernel_choice(kernels)
    for module in reversed(list(model.modules())):
        for value in list(vars(module).values()):  # plain attributes: Projections
            bind = getattr(type(value), "bind_kernels", None)
            if bind is not None and not isinstance(value, nn.Module):
                bind(value, choice)
        bind = getattr(type(module), "bind_kernels", None)
        if bind is not None:
            bind(module, choice)
    model.__dict__["kernels"] = choice
    _twins.pop(model, None)
    return model


def bound_with(model: nn.Module) -> KernelChoice | None:
    """The choice `model` was last finalized with (None: never)."""
    return model.__dict__.get("kernels")


def finalize_once(model: nn.Module, off: Iterable[str] = ()) -> nn.Module:
    """finalize(model, off) unless it is bound so already (an engine over a loaded model)."""
    choice = kernel_choice(off)
    return model if bound_with(model) == choice else finalize(model, choice)


_twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SCALARS = (int, float, bool, str, type(None))
_MODULE_DICTS = ("_parameters", "_buffers", "_modules")  # the tensors and modules, keyed apart


def torch_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` sharing every parameter and buffer (the same tensor objects), bound to
    torch's operators only (TORCH). Kept while the model is the same: the same tensors, modules
    and attributes (a planted bug that changes one gets a new twin); an adapter context the
    engine attached (`lora`) is left out: the twin computes the base model."""
    key = _fingerprint(model)
    cached = _twins.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    memo.update({id(m.__dict__["lora"]): None for m in model.modules() if "lora" in m.__dict__})
    twin = copy.deepcopy(model, memo)
    twin.__dict__.pop("kernels", None)
    finalize(twin, TORCH)
    _twins[model] = (key, twin)
    return twin


def _fingerprint(model: nn.Module) -> tuple:
    """Each module, tensor and plain attribute of `model` by identity or value."""
    found = []
    for module in model.modules():
        found.append(id(module))
        for name, value in module.__dict__.items():
            if name in _MODULE_DICTS:
                found += [(k, id(v)) for k, v in value.items()]
            elif name != "kernels":
                found.append((name, value if isinstance(value, _SCALARS) else id(value)))
    return tuple(found)
