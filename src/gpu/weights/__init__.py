"""Weights on the worker: loading at start-up (safetensors, GGUF, dummy), the worker's side of
a weight update from a trainer, the standby copy an update loads into, and the on-disk snapshot
that restarted workers load from.
"""
