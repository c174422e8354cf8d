"""Analytic FLOPs of one engine step, from the model's shape (behind --enable-mfu-metrics).

The engine core owns the count: after `Scheduler.schedule()` it knows, per request, how many
tokens the step computes and how many were already in the KV cache, which is all the
arithmetic below needs. The total travels to the frontend in `SchedulerStats.estimated_flops`
(a delta since the previous stats), where the Prometheus logger adds it to
`ringserve:estimated_flops_per_gpu_total` and the log line divides it by the interval (TF/s).

Counted, as vLLM's `metrics/perf.py` does, as 2 FLOPs per multiply-add of the matmuls:

* per layer and token: Q, K, V and O projections (`2*h*(nq*d) + 2*h*(2*nkv*d) + 2*(nq*d)*h`)
  and the gated MLP of Llama/Mistral/Qwen (`3 * 2*h*I`);
* per layer, attention over the context: a token at position `p` (0-based) attends to `p + 1`
  positions, costing `2*nq*d` for QK^T and as much for AV per position, so a chunk of `n`
  tokens after `c` cached ones costs `4*nq*d * (n*c + n*(n+1)/2)`;
* the unembedding of one logits row per scheduled request, `2*h*V`.

Norms, rotary embeddings, softmax and sampling are left out (a few percent at most). The
total is split evenly over the tensor-parallel ranks ("per GPU"). No torch: plain arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.config import EngineConfig
from ringserve.gpu.wire import SchedulerOutput


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """The model shape the FLOPs formula needs.

    Attributes:
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size,
        vocab_size: the model's shape.
        num_gpus: the ranks one engine's work is split over (tensor parallel size).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_gpus: int = 1

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelFlops:
        """Read the shape from the engine configuration (intermediate size from config.json)."""
        model = config.model_config
        intermediate = int(model.hf_config.get("intermediate_size", 4 * model.hidden_size))
        return cls(
            hidden_size=model.hidden_size,
            num_layers=model.num_hidden_layers,
            num_heads=model.num_attention_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            intermediate_size=intermediate,
            vocab_size=model.vocab_size,
            num_gpus=config.parallel_config.tensor_parallel_size,
        )

    def dense_flops_per_token(self) -> int:
        """Projection and MLP FLOPs of one token through all layers."""
        h, d = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_heads * d, self.num_kv_heads * d
        projections = 2 * h * q_out + 2 * h * 2 * kv_out + 2 * q_out * h
        mlp = 3 * 2 * h * self.intermediate_size
        return self.num_layers * (projections + mlp)

    def request_flops(self, num_tokens: int, num_computed_tokens: int) -> int:
        """FLOPs of computing `num_tokens` of one request after `num_computed_tokens` cached."""
        if num_tokens <= 0:
            return 0
        n, c = num_tokens, num_computed_tokens
        attended = n * c + n * (n + 1) // 2
        attention = self.num_layers * 4 * self.num_heads * self.head_dim * attended
        unembed = 2 * self.hidden_size * self.vocab_size
        return n * self.dense_flops_per_token() + attention + unembed

    def step_flops(self, scheduler_output: SchedulerOutput) -> float:
        """FLOPs per GPU of one scheduled step."""
        scheduled = scheduler_output.num_scheduled_tokens
        total = 0
        for new in scheduler_output.scheduled_new_reqs:
            total += self.request_flops(scheduled.get(new.req_id, 0), new.num_computed_tokens)
        for cached in scheduler_output.scheduled_cached_reqs:
            total += self.request_flops(scheduled.get(cached.req_id, 0),
                                        cached.num_computed_tokens)
        return total / self.num_gpus
