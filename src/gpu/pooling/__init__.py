"""Pooling models (issue 43): embeddings, classification and scoring after the last hidden
state (CLS / MEAN / LAST pooling, normalisation, classifier heads). Nothing is here yet:
`--runner pooling` is refused.
"""
