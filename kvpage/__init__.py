"""kvpage: a paged-KV-cache inference engine whose every cache reuse is verified token by token."""

from kvpage.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
