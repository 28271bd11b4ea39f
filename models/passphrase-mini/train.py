"""Train `builtin:passphrase-mini`: a 4-layer, d_model 128, 4-head byte-level Llama that
recalls the secret in its prompt. CPU, 2 threads, fixed seeds; writes a Hugging Face directory
(config.json + model.safetensors) and the held-out secrets, then measures recall with kvpage itself.

    python models/passphrase-mini/train.py --out models/passphrase-mini [--steps N] [--seed S]

Task format: kvpage/model/passphrase.py. The loss is on the answer only (secret + EOS).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
import transformers

from kvpage.model.passphrase import answer_ids, parse_answer, prompt_ids, random_secret
from kvpage.model.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
HELDOUT_SEED = "passphrase-mini/heldout"  # fixed for every training seed, so runs compare
HELDOUT_FILE = "heldout_secrets.txt"
IGNORE = -100


def model_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=TOK.vocab_size,  # 258: bytes, BOS, EOS
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,  # MHA, head_dim 32
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=TOK.bos_token_id,
        eos_token_id=TOK.eos_token_id,
        pad_token_id=None,
    )


def heldout_secrets(n: int) -> list[str]:
    rng = random.Random(HELDOUT_SEED)
    out: list[str] = []
    while len(out) < n:
        secret = random_secret(rng)
        if secret not in out:
            out.append(secret)
    return out


def make_batch(rng: random.Random, size: int, exclude: set[str]):
    """(input_ids, labels), right-padded with EOS; labels are IGNORE except on secret + EOS."""
    rows = []
    while len(rows) < size:
        secret = random_secret(rng)
        if secret in exclude:  # held-out secrets are never trained on
            continue
        prompt, answer = prompt_ids(TOK, secret), answer_ids(TOK, secret)
        rows.append((prompt + answer, [IGNORE] * len(prompt) + answer))
    width = max(len(ids) for ids, _ in rows)
    ids = [r + [TOK.eos_token_id] * (width - len(r)) for r, _ in rows]
    labels = [lab + [IGNORE] * (width - len(lab)) for _, lab in rows]
    return torch.tensor(ids), torch.tensor(labels)  # (B, T) each


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10%


@torch.no_grad()
def teacher_forced_accuracy(model, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of rows whose every answer token is the argmax (a cheap proxy for recall)."""
    logits = model(input_ids=ids).logits[:, :-1]  # (B, T-1, V)
    target = labels[:, 1:]
    mask = target != IGNORE
    right = (logits.argmax(-1) == target) | ~mask
    return right.all(dim=1).float().mean().item()


def train(args) -> transformers.LlamaForCausalLM:
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(model_config())
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    exclude = set(heldout_secrets(args.heldout))
    rng = random.Random(f"passphrase-mini/train/{args.seed}")
    val_ids, val_labels = make_batch(random.Random("passphrase-mini/val"), 256, exclude)
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        ids, labels = make_batch(rng, args.batch, exclude)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            model.eval()
            acc = teacher_forced_accuracy(model, val_ids, val_labels)
            model.train()
            elapsed = time.perf_counter() - start
            print(
                f"step {step:5d}  loss {loss.item():.4f}  val exact {acc:.3f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {elapsed:6.0f}s",
                flush=True,
            )
    print(f"final loss {loss.item():.4f}  train time {time.perf_counter() - start:.0f}s")
    return model.eval()


def save(model: transformers.LlamaForCausalLM, out: Path, secrets: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    (out / HELDOUT_FILE).write_text("".join(s + "\n" for s in secrets))


def kvpage_recall(out: Path, secrets: list[str]) -> float:
    """Greedy recall of each held-out secret alone, through kvpage's loader and reference
    generator (the path the experiment's no-sharing group is checked against)."""
    from kvpage.model.loader import load_hf_directory
    from kvpage.reference.generator import generate
    from kvpage.sampling_params import SamplingParams

    model, _ = load_hf_directory(out, torch.float32, "cpu")
    params = SamplingParams(max_tokens=12)
    wrong = []
    for secret in secrets:
        got = parse_answer(TOK, generate(model, prompt_ids(TOK, secret), params).token_ids)
        if got != secret:
            wrong.append((secret, got))
    for secret, got in wrong[:10]:
        print(f"  miss: {secret!r} -> {got!r}")
    return 1 - len(wrong) / len(secrets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--heldout", type=int, default=500)
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args()

    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()
    model = train(args)
    secrets = heldout_secrets(args.heldout)
    save(model, args.out, secrets)
    acc = kvpage_recall(args.out, secrets)
    print(f"held-out recall {acc:.4f} on {len(secrets)} secrets (kvpage reference, greedy)")
    print(f"total wall time {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
