"""Shared fixtures: tiny model directories (built once per cache) and the CUDA skip for `gpu`.

Model directories come from `ringserve.gpu.testing` and are cached under RINGSERVE_HOME
(scripts/test points it inside the project; a bare pytest run uses the same place).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RINGSERVE_HOME", str(_ROOT / ".cache" / "ringserve"))
os.environ.setdefault("HF_HOME", str(_ROOT / ".cache" / "hf"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# The long suites: single tests of ~8 s or more on the 2-core machine, marked `long` and left
# out of the default selection (pyproject addopts `-m "not long"`) so that `scripts/test`
# stays well under 10 minutes; another test in the default selection covers what each
# promises (named after it). `CI=true scripts/test` runs them after the default selection, in
# one process; run them alone with `scripts/test -m long`.
LONG = {
    "tests/gpu/spec_decode/test_eagle.py::test_greedy_equal_with_eagle_heads_at_tensor_parallel_2":
        "test_eagle.py::test_greedy_equal_with_an_eagle_head[llama] (TP 1)",
    "tests/gpu/spec_decode/test_eagle.py::test_greedy_equal_with_an_eagle_head[gemma3]":
        "test_eagle.py::test_greedy_equal_with_an_eagle_head[llama]",
    "tests/gpu/spec_decode/test_eagle.py::test_greedy_equal_with_an_eagle_head[qwen3moe]":
        "test_eagle.py::test_greedy_equal_with_an_eagle_head[llama]",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_quantized_target[int8]":
        "test_spec_greedy.py::test_greedy_equal_on_each_family[llama]",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_quantized_target[int4]":
        "test_spec_greedy.py::test_greedy_equal_on_each_family[llama]",
    "tests/gpu/spec_decode/test_spec_verify.py::"
    "test_verify_layout_matches_decodes_triton_under_interpreter":
        "test_verify_layout_matches_decodes_torch_backend",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_enforce_eager":
        "test_spec_greedy.py::test_greedy_equal_on_each_family[llama] (captured step)",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_preemption":
        "test_spec_scheduling.py's preemption cases",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_request_that_fills_max_model_len":
        "test_spec_scheduling.py's draft caps at max_model_len",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_request_that_fills_the_kv_cache":
        "test_spec_scheduling.py's lookahead cases",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_tensor_parallel_2":
        "test_spec_greedy.py::test_greedy_equal_on_each_family[llama] (TP=1)",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_greedy_equal_on_each_family[mistral]":
        "its [llama] case",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_greedy_equal_on_each_family[qwen2]":
        "its [llama] case",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_greedy_equal_on_each_family[qwen3]":
        "its [llama] case",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_greedy_equal_on_each_family[gemma2]":
        "its [llama] case",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_greedy_equal_on_each_family[gemma3]":
        "its [llama] case",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_greedy_equal_on_each_family[phi3]":
        "its [llama] case",
    "tests/gpu/spec_decode/test_spec_greedy.py::test_greedy_equal_on_each_family[qwen3moe]":
        "its [llama] case",
    "tests/chaos/test_chaos.py::test_chaos": "test_fault_tolerance.py",
    "tests/gpu/spec_decode/test_spec_requests.py::test_streamed_deltas_with_stop_strings":
        "test_spec_requests.py::test_stops_inside_accepted_runs and test_multi_token_stops.py",
    "tests/gpu/spec_decode/test_spec_requests.py::test_chunked_prefill_and_prefix_hits":
        "test_spec_greedy.py::test_greedy_equal_on_each_family[llama] and the scheduler's "
        "spec tests (tests/engine/sched/test_spec_scheduling.py)",
    "tests/http/test_http_group_stop.py::test_group_signal_drains_and_exits_zero"
    "[sigint-in-flight]": "its [sigterm-in-flight] case (the same drain, another signal)",
    "tests/engine/test_step_hold.py::test_keep_pauses_skip_queued_steps_and_tokens_match[uni]":
        "its [mp] case (the same pauses over the multiprocess executor)",
    "tests/http/pooling/test_http_pooling_chunked.py":
        "test_pooling_llm.py::test_chunked_processing_is_the_token_weighted_mean_of_the_chunks "
        "and test_pooling_inputs.py",
    "tests/http/pooling/test_http_score.py":
        "test_pooling_llm.py::test_cross_encoder_scores_and_classification and "
        "test_pooling_protocol.py",
    "tests/shm/test_shm_bench.py::test_short_run_reports_medians_headline_and_spin_cpu":
        "the bench's unit tests",
    "tests/http/test_http_fuzz.py": "the routes' own bad-body tests",
    "tests/http/test_http_server_deaths.py::test_server_sigkill_leaves_nothing_and_next_start_cleans":
        "test_llm.py::test_sigkilled_parent_leaves_no_engine_core",
    "tests/http/test_http_server_deaths.py::test_core_sigkill_is_restarted_with_fault_tolerance":
        "test_fault_tolerance.py::test_killed_core_is_restarted",
    "tests/http/test_http_server_deaths.py::test_core_sigkill_without_fault_tolerance_stops_the_server":
        "test_http_server.py::test_engine_death_ends_streams_then_exits_one",
    "tests/scripts/test_rl_loop_example.py": "test_weight_sync.py",
    "tests/test_cli.py::test_demo_model_writes_a_loadable_directory": "the demo fixtures",
    "tests/scripts/test_gpu_check.py::test_cpu_dry_run_end_to_end":
        "the gpu_check unit tests (wheel plan, step guard)",
    "tests/http/test_http_group_stop.py::test_group_signal_repeated":
        "test_group_signal_drains_and_exits_zero (each stop once)",
    "tests/http/test_http_group_stop.py::"
    "test_scaled_out_deployment_stops_cleanly_when_every_process_is_signalled":
        "test_group_signal_drains_and_exits_zero (the one-process server)",
    "tests/http/test_http_server.py::test_sigterm_drains_then_exits_zero[sigint-to-group]":
        "its [sigterm] case",
    "tests/engine/structured/test_constrained_generation.py::test_async_and_sync_scheduling_agree":
        "the other constrained-generation tests",
    "tests/engine/test_fault_tolerance.py::test_worker_hung_in_sleep_is_a_fault":
        "test_hung_worker_is_a_fault_and_the_recovery_timeout_ends_the_engine",
    "tests/engine/test_fault_tolerance.py::test_crash_looping_core_ends_the_engine":
        "test_killed_core_is_restarted",
    "tests/http/test_http_bench_serve.py::test_bench_serve_against_ringserve":
        "bench serve's unit tests",
    "tests/gpu/test_gpu_executor_ray.py": "the mp executor's tests",
    "tests/gpu/test_ray_cluster.py": "the mp executor's worker-death tests",
    "tests/scripts/test_bench_scaleout.py::"
    "test_a_tiny_real_run_streams_every_token_and_leaves_no_process": "the bench's unit tests",
    "tests/http/test_scaleout_server.py::"
    "test_a_core_that_cannot_start_stops_the_deployment_with_its_reason":
        "test_http_server.py::test_port_in_use_is_one_line (one-line start-up errors)",
    "tests/engine/test_scaleout_routing.py::"
    "test_each_frontend_gets_its_own_outputs_under_the_same_ids":
        "test_scaleout_server.py::test_200_streams_over_two_frontends_and_two_engines",
    "tests/http/test_scaleout_headless.py":
        "test_scaleout_routing.py (attached frontends) and test_cluster_auth.py (refused peers)",
    "tests/http/test_scaleout_server.py::"
    "test_killed_frontend_is_restarted_and_the_others_streams_go_on":
        "test_scaleout_routing.py::test_cores_abort_a_gone_frontends_requests",
    "tests/http/test_scaleout_server.py::test_sigterm_drains_every_frontend_then_exits_zero":
        "test_http_server.py::test_sigterm_drains_then_exits_zero[sigterm] (one frontend)",
    "tests/http/test_scaleout_server.py::test_sigkill_of_the_supervisor_leaves_no_process":
        "test_llm.py::test_sigkilled_parent_leaves_no_engine_core (the same lifelines)",
    "tests/gpu/test_gpu_triton.py::test_triton_kernels_match_reference_under_interpreter":
        "nothing on CPU (Triton runs only interpreted here)",
    "tests/gpu/test_gpu_executor_mp.py::test_sigkilled_parent_leaves_no_worker[2]": "its [1] case",
    "tests/checkpoint/test_gguf.py::test_llm_q8_0_gguf_logprobs_near_transformers":
        "test_llm_f32_gguf_greedy_equals_transformers",
    "tests/scripts/test_bench_scripts.py::test_scheduler_bench_says_where_the_vllm_figures_come_from":
        "the other bench-script tests",
    "tests/shm/test_shm_processes.py::test_million_checksummed_frames_two_processes":
        "the ring's other two-process tests",
    "tests/http/test_http_server.py::test_tensor_of_the_wrong_shape_is_one_line_and_exit_one":
        "test_http_server.py::test_port_in_use_is_one_line",
    "tests/http/test_http_server.py::test_tls_negotiates_h2_by_alpn": "the h2c tests",
    "tests/engine/structured/test_constrained_generation.py::"
    "test_mixed_batch_on_the_null_model_with_the_rings": "the other constrained-generation tests",
    "tests/gpu/test_family_parity.py::test_tp2_matches_transformers_for_each_family":
        "test_llm.py::test_mp_executor_tensor_parallel_matches_transformers[2]",
    "tests/engine/test_fault_tolerance.py::test_auto_retry_recovers_without_an_instruction":
        "test_worker_death_then_retry_then_abort",
    "tests/engine/test_fault_tolerance.py::test_hung_core_fails_its_streams_within_the_timeout":
        "test_hang_watch.py and test_dp_expert_parallel.py::"
        "test_hung_core_fails_every_stream_within_the_timeout",
    "tests/engine/test_dp_expert_parallel.py::test_sleep_level_2_is_all_cores_or_none":
        "test_lockstep_sleep.py and test_engine_core.py::test_hold_new_requests_for_a_lockstep_sleep",
    "tests/chaos/test_chaos_dp_ep.py::test_chaos_dp_ep":
        "test_dp_expert_parallel.py (a killed core, a hung core)",
    "tests/gpu/test_moe_parity.py::test_tp2_and_ep2_match_transformers[ep]":
        "test_moe_dispatch.py and test_dp_expert_parallel.py (EP over 4 and 2 ranks)",
    "tests/engine/test_moe_engine.py::test_quantized_experts_stay_close_to_float[int4]":
        "its [int8] case and test_moe_cpu_kernel.py's int4 tests",
    "tests/http/test_scaleout_elastic.py":
        "test_elastic_dp.py and test_http_elastic_dp.py (the same scale on one API server)",
    "tests/gpu/multimodal/test_vlm_engine.py::test_tensor_parallel_2_equals_tp_1":
        "test_vlm_engine.py::test_greedy_tokens_and_logprobs_equal_transformers[qwen2_vl] (TP=1)",
    "tests/weight_transfer/test_wt_vllm_loop.py::"
    "test_vllm_style_trainer_pushes_trained_weights[shm-2-qwen2]":
        "test_weight_sync.py::test_training_loop_pushes_weights[shm-2-qwen2] (TP 2 over shm) "
        "and test_wt_vllm_trainer.py (a vLLM-style source's records)",
}


def _is_long(nodeid: str) -> bool:
    return any(nodeid == key or nodeid.startswith(key + "::") for key in LONG)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_long(item.nodeid):
            item.add_marker(pytest.mark.long)
    # get_closest_marker, not `"gpu" in item.keywords`: keywords also hold directory names.
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """A 2-layer Llama (hidden 64, GQA 4/2 heads, vocab 8000)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_mistral_dir() -> Path:
    """A 2-layer Mistral (no sliding window)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    """A 2-layer Qwen2 (qkv bias, tied embeddings)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    """A 2-layer Qwen3 (q/k RMSNorm, head_dim 32 != hidden / heads)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def tiny_gemma2_dir() -> Path:
    """A 2-layer Gemma 2 (sliding window 8, attention and final soft-caps)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3_dir() -> Path:
    """A 2-layer Gemma 3 text model (q/k norms, local rope table, sliding window 8)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("gemma3")


@pytest.fixture(scope="session")
def tiny_phi3_dir() -> Path:
    """A 2-layer Phi-3 (fused qkv / gate_up checkpoint tensors, sliding window 8)."""
    from ringserve.gpu.testing import tiny_model

    return tiny_model("phi3")


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The demo model (Llama, hidden 256, 4 layers, vocab 8000)."""
    from ringserve.gpu.testing import demo_model_path

    return demo_model_path()


@pytest.fixture(params=["llama", "mistral", "qwen2", "qwen3"])
def tiny_model_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """Each tiny family in turn."""
    from ringserve.gpu.testing import tiny_model

    yield tiny_model(request.param)
