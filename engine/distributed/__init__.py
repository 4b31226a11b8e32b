"""Tensor parallelism: one process per rank, rank 0 drives (see docs/tensor-parallel.md)."""
