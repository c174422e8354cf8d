"""Sampling on the worker: logits processors, bad words, the grammar mask, token selection,
per-row sampling metadata, logprobs and prompt logprobs. The model runner calls `Sampler` once
per step.
"""
