"""Images in (issue 44): vision encoders in the worker, an encoder cache, and image content
hashes folded into block hashes. Nothing is here yet: image content parts are refused.
"""
