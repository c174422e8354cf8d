"""Paged attention: per-step metadata, the torch reference, Triton kernels and backend choice."""
