"""bench/roofline.py's arithmetic against counts taken from the models themselves: parameters of
transformers' model built on the meta device, int8 bytes of kvpage's own quantizer, FLOPs counted
by torch's FlopCounterMode over an eager forward pass per token, and KV bytes read as the size of
transformers' cache at every decode pass. Also: the solo table prints each row's roofline
fraction."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from bench import roofline, solo
from kvpage.model.int8 import quantize_per_channel

# throughput.py imports its bench/ neighbours by bare name; appended, so it shadows nothing
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import throughput  # noqa: E402


def meta_model(name: str) -> transformers.PreTrainedModel:
    cfg = throughput.model_config(name, 1024)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def config_dict(name: str) -> dict:
    return json.loads(throughput.model_config(name, 1024).to_json_string())


@pytest.mark.parametrize("name", ["125m", "qwen2.5-0.5b", "llama3.2-1b"])
def test_weight_counts_match_the_models_parameters(name):
    model = meta_model(name)
    layers = list(model.model.layers.parameters())
    cost = roofline.ModelCost.from_config(config_dict(name))
    assert cost.layer_matmul == sum(p.numel() for p in layers if p.dim() == 2)
    assert cost.layer_rows == sum(p.shape[0] for p in layers if p.dim() == 2)
    assert cost.layer_other == sum(p.numel() for p in layers if p.dim() == 1)
    assert cost.head == model.lm_head.weight.numel()
    # a pass reads everything but the embedding; a tied model's embedding is its head
    read = sum(p.numel() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        read -= model.model.embed_tokens.weight.numel()
    assert cost.weight_bytes("float32") == 4 * read
    assert cost.weight_bytes("bfloat16") == 2 * read
    # llama.cpp's Q8_0: 34 bytes per 32 weights of every matrix it reads, vectors in float32
    matrices = sum(p.numel() for p in layers if p.dim() == 2) + model.lm_head.weight.numel()
    vectors = read - matrices
    assert cost.q8_0_bytes() == matrices // 32 * 34 + 4 * vectors
    attn = [layer.self_attn for layer in model.model.layers]
    kv = sum(a.k_proj.out_features + a.v_proj.out_features for a in attn)
    assert cost.kv_width == kv
    assert cost.attn_width == sum(a.q_proj.out_features for a in attn)


def test_int8_bytes_are_what_kvpages_quantizer_makes():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(throughput.model_config("small", 1024))
    cost = roofline.ModelCost.from_config(model.config.to_dict())
    codes = scales = 0
    for p in model.model.layers.parameters():
        if p.dim() == 2:
            c, s = quantize_per_channel(p.to(torch.bfloat16), torch.bfloat16)
            codes, scales = codes + c.nbytes, scales + s.nbytes
    c, s = quantize_per_channel(model.lm_head.weight.to(torch.bfloat16), torch.bfloat16)
    others = 2 * sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 1)
    others += 2 * model.model.norm.weight.numel()
    head = 2 * model.lm_head.weight.numel()
    assert cost.weight_bytes("bfloat16", int8=True) == codes + scales + others + head
    both = codes + scales + others + c.nbytes + s.nbytes
    assert cost.weight_bytes("bfloat16", int8=True, int8_head=True) == both


TINY_QWEN2 = dict(  # q/k/v biases, GQA, untied: every term of the count
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def _forward(model, tokens: list[int], cache) -> list[int]:
    """Feeds `tokens` one at a time through the layers (each pass: one query against every
    position so far, as a decode); returns the cache's K and V element count after each pass."""
    sizes = []
    for t in tokens:
        pos = cache.get_seq_length()
        model.model(torch.tensor([[t]]), cache=cache, position_ids=torch.tensor([[pos]]))
        sizes.append(sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers))
    return sizes


def _count(model, prompts: list[list[int]], outs: list[int], shared: int) -> tuple[int, int]:
    """(FLOPs of the layers and head, KV elements read by decode passes), counted by running the
    model: the shared prefix once, each sequence from a copy of its cache, the head once per
    output (the prompt's last hidden state, then each decode's)."""
    counter = FlopCounterMode(display=False)
    base = transformers.DynamicCache(config=model.config)
    kv_read = 0
    with torch.no_grad(), counter:  # one counting span: entering the mode again resets it
        _forward(model, prompts[0][:shared], base)
        for prompt, out in zip(prompts, outs, strict=True):
            cache = copy.deepcopy(base)
            _forward(model, prompt[shared:], cache)
            kv_read += sum(_forward(model, list(range(3, 3 + out - 1)), cache))
            model.lm_head(torch.zeros(out, model.config.hidden_size))
    return counter.get_total_flops(), kv_read


def test_flops_and_kv_bytes_match_a_counted_run():
    cfg = transformers.Qwen2Config(**TINY_QWEN2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    prefix = [5, 6, 7, 8, 9]
    prompts = [prefix + [10, 11, 12], prefix + [13], prefix + [14, 15]]
    outs = [4, 1, 6]
    work = roofline.Work.of_generate(prompts, outs)
    assert work.shared == len(prefix) and work.decodes == (3, 0, 5) and work.passes == 6
    cost = roofline.ModelCost.from_config(cfg.to_dict())
    flops, kv_read = _count(model, prompts, outs, work.shared)
    assert roofline.flops(cost, work) == flops
    assert roofline.kv_bytes_read(cost, work, 2) == 2 * kv_read
    wb = cost.weight_bytes("bfloat16")
    assert roofline.bytes_read(cost, work, wb, 2) == 6 * wb + 2 * kv_read
    fl = roofline.floor(cost, work, bandwidth=1e9, peak=1e6, weight_bytes=wb, kv_bytes=2)
    assert fl.memory_s == (6 * wb + 2 * kv_read) / 1e9 and fl.compute_s == flops / 1e6
    assert fl.seconds == max(fl.memory_s, fl.compute_s)
    assert fl.bound == ("mem" if fl.memory_s >= fl.compute_s else "mm")


def test_common_prefix():
    assert roofline.common_prefix([[1, 2, 3]]) == 0  # one prompt: nothing shared
    assert roofline.common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert roofline.common_prefix([[1, 2], [1, 2]]) == 2
    assert roofline.common_prefix([[1], [2]]) == 0


def test_solo_table_prints_each_rows_roofline_fraction():
    wl = solo.make_workloads(["single"], vocab=100, seed=0, quick=True)
    cells = {
        ("single", "float32", "kvpage"): solo.Cell([2.0, 4.0, 8.0], [[1]]),
        ("single", "float32", "vllm"): solo.Cell(error="boom"),
    }
    floors = {("single", "float32", "kvpage"): roofline.Floor(memory_s=1.0, compute_s=0.5)}
    lines = solo.table(wl, ["float32"], ["kvpage", "vllm"], cells, floors=floors)
    assert "roofline" in lines[0]
    assert "50% (25%) mem" in lines[2]  # 1 s floor: fastest 2 s, median 4 s
    assert "50%" not in lines[3]


def test_llama_cpp_rows_take_batched_benchs_own_work():
    import solo_rounds  # bench/: after throughput's path entry

    prefix = solo.make_workloads(["prefix"], vocab=1000, seed=0, quick=False)[0]
    work, kv = solo_rounds.row_work("llama.cpp", prefix, "float32")
    bb = prefix.llama_cpp  # -pps -npp 512 -ntg 32 -npl 32: the one prompt shared, no tails
    # (solo_rounds imports bench/roofline.py as `roofline`: another module object, so fields)
    assert (work.prompts, work.decodes, work.shared) == ((512,) * 32, (32,) * 32, 512)
    assert (bb.npp, bb.ntg, bb.npl, bb.shared) == (512, 32, 32, True)
    assert kv == 2  # its KV cache is f16 whatever the weights
    work, kv = solo_rounds.row_work("kvpage", prefix, "bfloat16")
    assert work.prompts == tuple(map(len, prefix.prompts)) and kv == 2
    assert work.shared == 512 and work.decodes == tuple(m - 1 for m in prefix.max_tokens)


def test_machine_keeps_each_figures_best_measurement():
    one = roofline.Machine(2, 256, {"copy": 30.0, "read": 50.0}, (8, 4, 4), {"float32": 90.0})
    two = roofline.Machine(2, 256, {"copy": 45.0, "read": 40.0}, (8, 4, 4), {"float32": 80.0})
    best = one.best_with(two)
    assert best.bandwidth_gbs == {"copy": 45.0, "read": 50.0}
    assert best.peak_gflops == {"float32": 90.0}
    assert best.bytes_per_s == 50e9 and best.flops_per_s("float32") == 90e9
