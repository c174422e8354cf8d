"""Metrics: scheduler and iteration statistics and the loggers they are fanned out to.

`stats.py` derives iteration and per-request statistics in the frontend, `flops.py` estimates
a step's FLOPs in the core (MFU), `expert_load.py` pulls MoE expert-load counts from the
workers into the core's stats, `stat_loggers.py` fans them out to the logging logger and
the Prometheus logger (`prometheus.py`), `spec_decode.py` turns speculative decoding's counts
into counters and a log line for both, and `metrics_reader.py` reads a snapshot of the series
back (`LLM.get_metrics()`, `AsyncLLM.get_metrics()`).
"""
