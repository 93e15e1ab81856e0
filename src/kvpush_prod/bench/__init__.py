"""Benchmarks: ``kvpush bench`` (side by side against vLLM's own connectors), the NIXL
transfer microbenchmark (``kvpush bench transfer``) and their reports."""
