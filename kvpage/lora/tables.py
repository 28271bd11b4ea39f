"""The stacked slot tables the resident adapters are computed from: per (layer, projection),
A^T of every slot side by side (in, max_loras * max_lora_rank) and scale * B^T of every slot
stacked (max_loras * max_lora_rank, out); slot s owns columns / rows [s * R, s * R + r) and
zeros up to (s + 1) * R.

Why stacked: a mixed batch then costs the same three ops per projection however many adapters
it mixes (kvpage.lora.apply), where a gather, two matmuls and a scatter per adapter group made
the dispatch, not the arithmetic, the cost of a decode step. Under tensor parallelism every rank
keeps tables of its own shard of each factor (kvpage.parallel.sharding.shard_lora_factors).

A float32 model on CPU computes from `native` copies (A of every slot as rows, each slot's rank
per projection) with kvpage.lora.native_delta: each row meets only its own adapter's columns,
where the stacked products give every row every slot's and mask all but one away (L times the
arithmetic for L adapters: a quarter of a 125M model's decode step at 32 rows x 4 adapters of
rank 16, bench/lora_mixed.py). Elsewhere, on CPU in float32 or bfloat16, the tables are kept
reordered for oneDNN (`packed`): at decode shapes a plain GEMM ran the two products at a
fraction of oneDNN's speed on a prepacked weight. Both copies are remade whenever a slot is
written."""

from __future__ import annotations

import torch

from kvpage.errors import LoRAError
from kvpage.lora import native_delta
from kvpage.model.linear_kernels import onednn_available, packable_dtype

# (layer, module) -> (A^T (in, r), scale * B^T (r, out)): x @ A^T @ B^T is the delta
Factors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class SlotTables:
    def __init__(
        self, max_loras: int, max_rank: int, dtype: torch.dtype, device: str | torch.device
    ) -> None:
        # A 16-bit model's tables are float32: the delta is accumulated in float32 and added
        # to the base output before one rounding (as vLLM's LoRA kernels accumulate). Rounding
        # x A^T, the delta and the sum to bfloat16 apart put a decode step 0.49 from the
        # float32 truth where the base model alone is 0.06: more than the dtype's rule allows.
        self.dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        self.model_dtype = dtype
        self.max_loras, self.max_rank, self.device = max_loras, max_rank, device
        # (layer, module) -> (A^T of every slot (in, L * R), scale * B^T of every slot (L * R, out))
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        # the same, as oneDNN weights ((L * R, in) and (out, L * R), reordered), where they run
        self.packed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        # each slot's rank per (layer, module): 0 where its adapter has no factor there
        self.ranks: dict[tuple[int, str], torch.Tensor] = {}
        # where the native delta runs (kvpage.lora.native_delta): A of every slot as rows
        # (L * R, in) beside the B^T stack, and the ranks
        self.native: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def width(self) -> int:
        return self.max_loras * self.max_rank

    def write(self, slot: int, factors: Factors) -> None:
        """Slot `slot` of every table := `factors`, zero where the adapter has no factor (the
        slot's previous adapter may have targeted projections this one does not)."""
        lo, rank_max = slot * self.max_rank, self.max_rank
        self.clear_slot(slot, factors)
        for where, (a_t, b_t) in factors.items():
            rank = a_t.shape[1]
            if rank > rank_max:
                raise LoRAError(f"an adapter of rank {rank} exceeds max_lora_rank={rank_max}")
            if where not in self.stacks:
                self.stacks[where] = self._zeros(a_t.shape[0], b_t.shape[1])
                self.ranks[where] = torch.zeros(self.max_loras, dtype=torch.int64)
            a_stack, b_stack = self.stacks[where]
            a_stack[:, lo : lo + rank] = a_t
            b_stack[lo : lo + rank] = b_t
            self.ranks[where][slot] = rank
        self._repack()

    def clear_slot(self, slot: int, factors: Factors) -> None:
        """Zero slot `slot`'s columns / rows of every table before `factors` are written there
        (a declared seam): of every projection, not only those `factors` target, or a slot
        reused by an adapter with fewer targets keeps its previous adapter's factors."""
        lo, hi = slot * self.max_rank, (slot + 1) * self.max_rank
        for a_stack, b_stack in self.stacks.values():
            a_stack[:, lo:hi] = 0
            b_stack[lo:hi] = 0
        for ranks in self.ranks.values():
            ranks[slot] = 0

    @property
    def native_runs(self) -> bool:
        """Whether the native delta computes from these tables (float32 on CPU, built)."""
        cpu = torch.device(self.device).type == "cpu"
        return cpu and self.model_dtype is torch.float32 and native_delta.available()

    def _repack(self) -> None:
        """Every table's native and oneDNN copies, after a write (every table's slot changed:
        zeros at least)."""
        self.native = {}
        if self.native_runs:
            self.native = {
                where: (a.t().contiguous(), b, self.ranks[where])
                for where, (a, b) in self.stacks.items()
            }
            self.packed = {}
            return
        packable = (
            torch.device(self.device).type == "cpu"
            and packable_dtype(self.dtype)
            and onednn_available()
        )
        if not packable:
            self.packed = {}
            return
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.packed = {
            where: (reorder(a.t().contiguous()), reorder(b.t().contiguous()))
            for where, (a, b) in self.stacks.items()
        }

    def row_mask(self, slot_rows, num_rows: int) -> torch.Tensor:
        """(N, L * R): ones over the slot columns of each row's adapter, zeros elsewhere (a base
        row's delta is then exactly 0). `slot_rows`: (slot, rows (n,) long or None: every row)."""
        mask = torch.zeros(num_rows, self.width, dtype=self.dtype, device=self.device)
        for slot, rows in slot_rows:
            lo = slot * self.max_rank
            if rows is None:
                mask[:, lo : lo + self.max_rank] = 1
            else:
                mask[rows, lo : lo + self.max_rank] = 1
        return mask

    def _zeros(self, fan_in: int, fan_out: int) -> tuple[torch.Tensor, torch.Tensor]:
        like = {"dtype": self.dtype, "device": self.device}
        return torch.zeros(fan_in, self.width, **like), torch.zeros(self.width, fan_out, **like)
