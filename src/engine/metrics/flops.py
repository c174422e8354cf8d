"""Analytic FLOPs of one engine step, from the model's shape (behind --enable-mfu-metrics).

The engine core owns the count: after `Scheduler.schedule()` it knows, per request, how many
tokens the step computes and how many were already in the KV cache, which is all the
arithmetic below needs. The total travels to the frontend in `SchedulerStats.estimated_flops`
(a delta since the previous stats), where the Prometheus logger adds it to
`ringserve:estimated_flops_per_gpu_total` and the log line divides it by the interval (TF/s).

Counted, as vLLM's `metrics/perf.py` does, as 2 FLOPs per multiply-add of the matmuls:

* per layer and token: Q, K, V and O projections (`2*h*(nq*d) + 2*h*(2*nkv*d) + 2*(nq*d)*h`)
  and the gated MLP of Llama/Mistral/Qwen (`3 * 2*h*I`);
* on the sparse layers of a mixture-of-experts model (`ringserve.moe_shape`), instead of the
  MLP, only what a token activates: the router (`2*h*E`), its top-k experts
  (`k * 3 * 2*h*I_moe`) and, where there is one (Qwen2-MoE), the shared expert and its gate
  (`3 * 2*h*I_shared + 2*h`); the dense layers of such a model keep the `intermediate_size`
  MLP;
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
from ringserve.moe_shape import MoeShape, moe_shape


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """The model shape the FLOPs formula needs.

    Attributes:
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size,
        vocab_size: the model's shape (`intermediate_size`: the dense MLP's).
        num_gpus: the ranks one engine's work is split over (tensor parallel size).
        moe: the experts of a mixture-of-experts model (None: dense).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_gpus: int = 1
    moe: MoeShape | None = None

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
            moe=moe_shape(model),
        )

    def dense_flops_per_token(self) -> int:
        """Projection and MLP (or activated experts) FLOPs of one token through all layers."""
        h, d = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_heads * d, self.num_kv_heads * d
        projections = 2 * h * q_out + 2 * h * 2 * kv_out + 2 * q_out * h
        mlp = 3 * 2 * h * self.intermediate_size
        total = self.num_layers * (projections + mlp)
        moe = self.moe
        if moe is not None:
            sparse = moe.top_k * 3 * 2 * h * moe.moe_intermediate_size + 2 * h * moe.num_experts
            if moe.shared_expert_intermediate_size:
                sparse += 3 * 2 * h * moe.shared_expert_intermediate_size + 2 * h
            total += len(moe.sparse_layers) * (sparse - mlp)
        return total

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
