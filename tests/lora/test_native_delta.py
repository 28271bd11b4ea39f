"""The native LoRA delta (kvpage/model/native/lora_delta.cpp via kvpage.lora.native_delta)
against the dense formula computed here per row in float64: y[i] + x[i] A_s^T (scale B_s^T)
for each adapter row i of slot s, y[i] for a base row; rows in any order and slot, ranks below
the slots' maximum, and y a column slice of a fused output (q of a qkv projection)."""

from __future__ import annotations

import pytest
import torch

from kvpage.lora import native_delta
from kvpage.lora.tables import SlotTables

pytestmark = pytest.mark.skipif(not native_delta.available(), reason="needs a C++ compiler")
TOL = 1e-5  # float32 sums of 768 products against float64


def _tables(ranks: list[int], fan_in: int, fan_out: int, max_rank: int = 16):
    g = torch.Generator().manual_seed(3)
    tables = SlotTables(len(ranks), max_rank, torch.float32, "cpu")
    factors = {}
    for slot, rank in enumerate(ranks):
        if rank:
            a_t = torch.randn(fan_in, rank, generator=g) / fan_in**0.5
            b_t = torch.randn(rank, fan_out, generator=g)
            factors[slot] = (a_t, b_t)
            tables.write(slot, {(0, "q_proj"): (a_t, b_t)})
    return tables, factors


@pytest.mark.parametrize("strided", [False, True])
def test_each_row_gets_its_own_adapters_delta_and_base_rows_none(strided):
    n, fan_in, fan_out = 13, 96, 80
    tables, factors = _tables([16, 5, 0, 9], fan_in, fan_out)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, fan_in, generator=g)
    fused = torch.randn(n, fan_out * 3, generator=g)
    y = fused[:, fan_out : 2 * fan_out] if strided else fused[:, :fan_out].contiguous()
    # slot 0: rows 7, 2, 11; slot 1: row 0; slot 3: rows 5, 6; slot 2 (rank 0 here): row 9
    slot_rows = [
        (0, torch.tensor([7, 2, 11])),
        (1, torch.tensor([0])),
        (3, torch.tensor([5, 6])),
        (2, torch.tensor([9])),
    ]
    want = y.double().clone()
    for slot, rows in slot_rows:
        if slot in factors:
            a_t, b_t = factors[slot]
            want[rows] += x[rows].double() @ a_t.double() @ b_t.double()
    before = fused.clone()
    step = native_delta.delta_rows(slot_rows, n, tables.max_rank)
    native_delta.add_delta(x, y, *tables.native[(0, "q_proj")], step)
    assert (y.double() - want).abs().max() <= TOL
    if strided:  # the other columns of the fused output are untouched
        assert torch.equal(fused[:, :fan_out], before[:, :fan_out])
        assert torch.equal(fused[:, 2 * fan_out :], before[:, 2 * fan_out :])


def test_every_row_of_one_adapter_and_a_cleared_slot():
    n, fan_in, fan_out = 32, 768, 256
    tables, factors = _tables([16, 16], fan_in, fan_out)
    x = torch.randn(n, fan_in, generator=torch.Generator().manual_seed(5))
    y = torch.zeros(n, fan_out)
    a_t, b_t = factors[1]
    native_delta.add_delta(
        x, y, *tables.native[(0, "q_proj")], native_delta.delta_rows([(1, None)], n, 16)
    )
    assert (y.double() - x.double() @ a_t.double() @ b_t.double()).abs().max() <= 1e-4
    tables.write(1, {})  # another adapter, targeting nothing here: slot 1 reads zeros
    y = torch.zeros(n, fan_out)
    native_delta.add_delta(
        x, y, *tables.native[(0, "q_proj")], native_delta.delta_rows([(1, None)], n, 16)
    )
    assert not y.any()


def test_rows_outside_the_pass_are_refused():
    with pytest.raises(ValueError, match="outside"):
        native_delta.delta_rows([(0, torch.tensor([0, 4]))], 4, 16)
