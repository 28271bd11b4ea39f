"""The trained-tokenizer directories the tests build: kvpage.verify.stack.tokenizer_dirs (the gate
builds the same ones for its stack stage)."""

from kvpage.verify.stack.tokenizer_dirs import build, write_bpe_tokenizer, write_spm_tokenizer

__all__ = ["build", "write_bpe_tokenizer", "write_spm_tokenizer"]
