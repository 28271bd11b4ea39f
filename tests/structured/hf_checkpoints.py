"""Random-weight Llama checkpoints with real trained tokenizers, for the greedy oracle: a
SentencePiece-style BPE (Llama 2's layout: <unk> <s> </s>, the 256 byte-fallback pieces, then
merged pieces behind a "▁" word marker) and a byte-level BPE (GPT-2 / Llama 3 / Qwen2's). Both
are trained here with `tokenizers` on JSON-ish text, so multi-byte tokens such as `{"`, `":` and
whole keys exist and a grammar must be matched across token boundaries."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from .constraints import KEYS, WORDS

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: pad, bos, eos
VOCAB_SIZE = 600


def corpus(lines: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(lines):
        obj = {
            k: rng.choice([rng.randint(-99, 999), rng.choice(WORDS), True, [], {}])
            for k in rng.sample(KEYS, 3)
        }
        texts.append(json.dumps(obj, separators=(",", ":")))
        texts.append(" ".join(rng.choice(WORDS) for _ in range(8)) + f" {rng.randint(0, 9999)}-x")
    return texts


def _save(tok: Tokenizer, directory: Path) -> int:
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def spm_style(directory: Path) -> int:
    """Llama 2's layout: merges trained on "▁"-marked text, then rebuilt with byte fallback."""
    marker = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    draft = Tokenizer(models.BPE())
    draft.normalizer = marker
    # SentencePiece merges within a word: the draft splits before each marker
    draft.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
    trainer = BpeTrainer(vocab_size=VOCAB_SIZE - 256, special_tokens=SPECIALS, show_progress=False)
    draft.train_from_iterator(corpus(), trainer)
    trained = json.loads(draft.to_str())["model"]
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = marker
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return _save(tok, directory)


def byte_level(directory: Path) -> int:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return _save(tok, directory)


TOKENIZERS = {"spm": spm_style, "byte-bpe": byte_level}


def build(kind: str, directory: Path) -> Path:
    """tokenizer.json, tokenizer_config.json, config.json and the random weights."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = TOKENIZERS[kind](directory)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,  # logits far from ties: greedy agrees across kernels
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).float().eval().save_pretrained(directory)
    return directory
