"""Executors: how an engine core drives its workers (in-process, worker processes, Ray).

`select.executor_class(config)` picks one; the engine core only sees the `Executor`
interface in `base.py`.
"""
