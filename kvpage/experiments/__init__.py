"""Experiments built on the engine: the passphrase contamination study."""
