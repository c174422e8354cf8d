"""The model layers every architecture shares: tensor-parallel linears and their
quantized forms, RMSNorm, rotary embeddings, the vocabulary embedding and LM head, and the
tensor-parallel group they compute over.
"""
