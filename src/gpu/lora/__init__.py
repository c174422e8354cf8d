"""Multi-LoRA serving (issue 42): adapters read into host memory, copied into a fixed number of
slots, and applied by grouped shrink / expand inside the linear layers. Nothing is here yet:
`--enable-lora` is refused.
"""
