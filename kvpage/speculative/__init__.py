"""Speculative decoding (issue 44): proposers (n-gram prompt lookup, a draft model) and the
rejection rule that keeps the target's output distribution. The engine's verification step is
built on these."""
