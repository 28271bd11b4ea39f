"""Hugging Face directories with real tokenizers for the whole-stack suite, built here without
network: a random-weight Llama (kvpage.verify.model_oracle.families' "llama-mha", vocabulary
320) and a tokenizer trained by the `tokenizers` library to exactly that vocabulary, with a
tokenizer_config.json (bos/eos, add_bos_token, a chat template). `build` uses the tokenizers
this module trained once and ships (tokenizers/{spm,bpe}.json; `python -m
kvpage.verify.stack.tokenizer_dirs` trains and writes them anew), `train` a fresh one:

  - `spm`: Llama-2 style — <unk> <s> </s>, the 256 byte-fallback tokens <0x00>..<0xFF>, then
    BPE pieces over ▁ (Metaspace); the decoder ▁ -> space, ByteFallback, Fuse, Strip the first
    space; BOS prepended by the post-processor;
  - `bpe`: Llama-3 / GPT-2 style byte-level BPE — the 256 byte symbols, merges, <|begin_of_text|>
    prepended.

The corpus mixes ASCII words with multi-byte characters, so the trained pieces split some of
them into bytes and the random model samples byte tokens freely."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kvpage.verify.model_oracle.families import VOCAB, save_family

CORPUS = [
    "the cat sat on the mat; the dog ran to the park and back",
    "hello world, héllo wörld: café, naïve, über, señor",
    "numbers 0123 456 789 and €5 or £7, ☃ snow ☃, 中文 text, 😀",
    "def f(x): return x * 2  # code, [brackets] {braces} <tags>",
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _config(directory: Path, bos: str, eos: str, unk: str | None) -> None:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": unk or eos,
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _trained(model, pre_tokenizer, vocab_size: int, specials: list[str]):
    from tokenizers import Tokenizer, trainers

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizer
    # The most frequent characters only: the rest (é, ☃, 中, 😀) are spelled in byte tokens.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, limit_alphabet=30)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return json.loads(tok.to_str())["model"]


def sentencepiece_decoder():
    """Llama 2's decoder: ▁ -> space, byte-fallback bytes joined, pieces fused, the text's
    first space stripped."""
    from tokenizers import decoders

    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])


def write_spm_tokenizer(directory: Path, vocab_size: int) -> None:
    """SentencePiece-style BPE with byte fallback, `vocab_size` tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    specials = ["<unk>", "<s>", "</s>"]
    meta = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    words = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    pieces = vocab_size - len(specials) - 256
    trained = _trained(models.BPE(unk_token="<unk>"), words, pieces + len(specials), specials)
    vocab = {t: i for i, t in enumerate(specials)}
    vocab |= {f"<0x{b:02X}>": len(specials) + b for b in range(256)}
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab and len(vocab) < vocab_size:
            vocab[piece] = len(vocab)
    merges = [
        (a, b)
        for a, b in (m if isinstance(m, list) else m.split(" ") for m in trained["merges"])
        if a in vocab and b in vocab and a + b in vocab
    ]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    tok.pre_tokenizer = meta
    tok.decoder = sentencepiece_decoder()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    tok.save(str(directory / "tokenizer.json"))
    _config(directory, "<s>", "</s>", "<unk>")


def write_bpe_tokenizer(directory: Path, vocab_size: int) -> None:
    """Byte-level BPE (GPT-2's byte alphabet), `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>"]  # ids 0 1 2
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1)]
    )
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, tok.get_vocab_size()
    tok.save(str(directory / "tokenizer.json"))
    _config(directory, "<|begin_of_text|>", "<|end_of_text|>", None)


SHIPPED = Path(__file__).parent / "tokenizers"  # {kind}.json: what train_tokenizer wrote once
KINDS = ("spm", "bpe")


def build(directory: Path, kind: str) -> Path:
    """A random-weight Llama (bos 1, eos 2) with the shipped `kind` ("spm" or "bpe") tokenizer:
    the same vocabulary on every machine (training one is not deterministic: pairs that tie
    merge in hash order, and each vocabulary draws other byte runs)."""
    _model(directory)
    shutil.copyfile(SHIPPED / f"{kind}.json", directory / "tokenizer.json")
    _tokenizer_config(directory, kind)
    return directory


def train(directory: Path, kind: str) -> Path:
    """As `build`, with a tokenizer trained anew (another vocabulary each time)."""
    _model(directory)
    (write_spm_tokenizer if kind == "spm" else write_bpe_tokenizer)(directory, VOCAB)
    return directory


def _model(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    save_family("llama-mha", directory)


def _tokenizer_config(directory: Path, kind: str) -> None:
    if kind == "spm":
        _config(directory, "<s>", "</s>", "<unk>")
    else:
        _config(directory, "<|begin_of_text|>", "<|end_of_text|>", None)


if __name__ == "__main__":  # python -m kvpage.verify.stack.tokenizer_dirs: train and ship anew
    import tempfile

    for kind in KINDS:
        with tempfile.TemporaryDirectory() as tmp:
            (write_spm_tokenizer if kind == "spm" else write_bpe_tokenizer)(Path(tmp), VOCAB)
            SHIPPED.mkdir(exist_ok=True)
            shutil.copyfile(Path(tmp) / "tokenizer.json", SHIPPED / f"{kind}.json")
            print(f"wrote {SHIPPED / f'{kind}.json'}")
