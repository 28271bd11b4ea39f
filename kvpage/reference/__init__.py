"""The contiguous reference generator, the KV round-trip oracle, the int8-weight oracle and
the step records both sides write: a leaf that the verifier and the server's shadow check use.
It imports no paging, prefix-cache or scheduling code."""
