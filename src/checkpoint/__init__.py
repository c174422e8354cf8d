"""Checkpoints as users have them: model ids resolved through the Hugging Face cache
(`hub`), GGUF files (`gguf_file`), and the checks on safetensors directories."""
