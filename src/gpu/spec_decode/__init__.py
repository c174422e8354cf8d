"""Speculative decoding (issue 41): one module per concern, one per proposer.

- `config`: `--speculative-config` / `LLM(speculative_config=...)` checked and resolved
  (`SpecDecodeConfig`, in `ringserve.config`).
- `proposer`: the `Proposer` protocol and the factory the model runner calls; `ngram` (prompt
  lookup), `draft_model` (a second model with its own KV over the same blocks, the
  target's own checkpoint over int4 panels included) and `eagle` (EAGLE-1/2 and EAGLE-3
  heads, `eagle_head` / `eagle_config`, reading the target's hidden states) implement it.
- `verify`: a verify step's layout (each draft position a one-token query of its own, so it
  runs through the captured decode step with single-token arithmetic).
- `scheduling`: the engine core's side (drafts per request, lookahead slots, rollback over
  rejected drafts, the never-slower `DraftController`, the counts for metrics).

The rejection sampler lives in `ringserve.gpu.sample.rejection`. The shared paths meet this
package at one seam each: the scheduler (`Scheduler(spec=...)`), the model runner
(`prepare_verify`, `sample_with_drafts`, `Proposer`), the engine core's grammar bitmask (a row
per draft position) and the worker's KV sizing (`ModelRunner.kv_bytes_per_block`). Imports no
torch here: the configuration and the scheduler import this package.
"""
