"""The engine core's scheduling: the scheduler policy and the managers it sits on.

`scheduler.py` (with the output side in `scheduler_update.py`) decides each step; under it sit
the waiting queue (`request_queue.py`), the per-request state (`request.py`), admission limits
(`admission.py`, also used by the frontend before it sends a request) and the KV cache manager
(`kv_cache_manager.py`) over the block pool (`block_pool.py`) and its prefix-cache hash chain
(`block_hash.py`). Plain Python over the wire structs: no trio, zmq or torch.
"""
