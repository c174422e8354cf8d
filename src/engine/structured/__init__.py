"""Structured outputs: grammar backends, the compile cache and the per-step bitmask.

`backend.py` is the seam (`StructuredOutputBackend`, `GrammarMatcher`, the bitmask layout);
`xgrammar_backend.py` and `guidance_backend.py` implement it (the latter's structural tags are
converted by `guidance_structural_tag.py`, over `guidance_lexing.py` and `xgrammar_regex.py`);
`validation.py` checks a request's constraint in the frontend (a 400 before anything reaches
the core); `manager.py` is the engine core's side: grammars compiled off the busy loop and
cached by spec, and one packed bitmask per step for the constrained rows, computed while the
forward runs.
"""
