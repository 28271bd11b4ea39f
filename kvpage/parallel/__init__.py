"""Tensor parallelism over torch.distributed (gloo on CPU): rank 0 runs the engine, ranks
1..N-1 are worker processes holding their weight and KV shards (kvpage.parallel.executor)."""
