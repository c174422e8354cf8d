"""Pooling models (issue 43): embeddings, classification and scoring after the last hidden
state. `layout` resolves the pooler from a checkpoint's sentence-transformers files and
`--pooler-config`; `engine_config` decides the runner and the engine settings pooling needs;
`encoder` holds the bidirectional encoders (BERT, XLM-RoBERTa) and their classifier heads;
`pooler` pools a packed batch (CLS / MEAN / LAST), normalises and activates; `encoder_runner`
runs an encoder's steps in the worker; `decoder` pools the hidden states of the decoder
families (Qwen3-Embedding style) inside the model runner. Nothing here is imported by this
package's `__init__` (the frontend reads `layout` without torch).
"""
