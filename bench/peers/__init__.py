"""Benchmark peers that run outside this process (bench scripts only; nothing in kvpage imports
these). Each peer module builds or locates its own binary in a cache directory outside the repo."""
