"""The frontend process: what runs next to the HTTP server or in the user's own process.

`AsyncLLM` (trio) and `LLM` / `LLMEngine` (sync), input processing (validation, tokenization),
output processing (incremental detokenization, stop strings, logprobs, n > 1 fan-out), and the
clients that reach the engine cores (in-process, multiprocess sync and async, data-parallel,
attached to cores another process started). Talks to `ringserve.engine.core` only through the
messages of `ringserve.engine.wire`.
"""
