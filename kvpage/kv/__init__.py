"""The KV pool's tensors: storage, quantized formats and their scales, the swap space."""
