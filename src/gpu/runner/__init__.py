"""The model runner: one step from a `SchedulerOutput` to a `ModelRunnerOutput`, with the
persistent request table, input preparation, the paged KV cache, the captured decode step and
the per-request checks made before a request joins the batch.
"""
