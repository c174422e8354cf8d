"""Multi-LoRA serving (issue 42): PEFT adapters applied to the base model's linear layers, with
requests under different adapters and the base model batched in one step.

- `adapter_config`: `adapter_config.json` read and checked (no torch; the frontend uses it to
  refuse a bad adapter naming the field or file).
- `weights`: `adapter_model.safetensors` read and checked against the base model's shapes,
  as scaled deltas on ringserve's fused `qkv_proj` / `o_proj` / `gate_up_proj` / `down_proj`.
- `layers`: the math: `--max-loras` slots on the device, the step's rows grouped by slot; a
  step with several adapters and few rows runs every adapter's shrink / expand as two stacked
  matmuls under a per-row mask, larger ones one group per adapter; added around the existing
  linear layers (`install_lora`); base rows are bit-identical to the model without LoRA.
- `manager`: the worker's books (which request runs under which adapter, adapters kept in
  memory, slots), called by the model runner.
- `testing`: random PEFT adapters for the tests.
"""
