"""Experiments built on the engine: the passphrase contamination study (R26-R28)."""
