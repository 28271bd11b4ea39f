"""What stands between each family's module forward and a decode tape (issue 41.2): the torch
operators that compute data (not views, not allocations) inside the decoder layers on one
decode-only paged step, per family, with the decode plan off:

    python bench/decode_tape_blockers.py [--families llama,qwen3,...] [--dtype bfloat16]

A tape records the bound native kernels' calls of one decode step and replays them; it can only
be derived from a layer whose decode step makes no other data-computing operator (each listed
here would have to become a bound native kernel, or move before the layers as a step input).
Counts are per step over all layers (the 125M shape of decode_fast_path.py, 12 layers). The
first layer's per-step checks of the block tables and slots (item, min, max: the paged decode
kernel's and the KV write's, once per step and KV group) are no blockers: a tape makes them
before it replays."""

from __future__ import annotations

import argparse
import collections
import tempfile

import torch
import transformers
from decode_fast_path import FAMILIES, OFF, engine, save
from torch.utils._python_dispatch import TorchDispatchMode

from kvpage.model.decode_tape import computes  # the tape's own rule: a blocker is what it refuses


class Blockers(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside and computes(func):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def blockers(family: str, args) -> collections.Counter[str]:
    with tempfile.TemporaryDirectory() as directory:
        save(family, directory)
        llm = engine(directory, args, OFF)
        mode = Blockers()
        layers = llm.engine.model.model.layers
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_: setattr(mode, "inside", 1))
            layer.register_forward_hook(lambda *_: setattr(mode, "inside", 0))
        with mode, torch.no_grad():
            llm.engine.step()
        return mode.ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.seqs, args.rounds, args.steps = 1, 1, 1
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    for family in args.families.split(","):
        ops = blockers(family, args)
        total = sum(ops.values())
        listed = ", ".join(f"{name} x{n}" for name, n in ops.most_common())
        print(f"{family:>15}: {total:4d} data ops in the layers per decode step: {listed or '-'}")


if __name__ == "__main__":
    main()
