"""Images' metrics (issue 44): vLLM's `mm_cache_queries` / `mm_cache_hits` count the
frontend's processed-image cache lookups per image, and `encoder_cache_usage_perc` reports
the workers' encoder cache."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from ringserve import LLM, SamplingParams
from ringserve.gpu.multimodal.testing import tiny_vlm


def _value(metrics: list[object], name: str) -> float:
    found = [getattr(m, "value", 0.0) for m in metrics if getattr(m, "name", "") == name]
    assert found, f"{name} not exported"
    return float(sum(found))


@pytest.mark.slow
def test_processed_image_cache_and_encoder_cache_metrics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGSERVE_ENABLE_MULTIPROCESSING", "0")
    rng = np.random.default_rng(7)
    image = Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    other = Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    with LLM(str(tiny_vlm("qwen2_vl")), max_model_len=512, kv_cache_memory=32 << 20,
             limit_mm_per_prompt={"image": 2}) as llm:
        prompt = "<|vision_start|><|image_pad|><|vision_end|> what is it?"
        params = SamplingParams(max_tokens=2, temperature=0.0)
        for picture in (image, image, other):
            llm.generate({"prompt": prompt, "multi_modal_data": {"image": picture}}, params,
                         use_tqdm=False)
        metrics = llm.get_metrics()
        assert _value(metrics, "ringserve:mm_cache_queries") == 3
        assert _value(metrics, "ringserve:mm_cache_hits") == 1
        usage = _value(metrics, "ringserve:encoder_cache_usage_perc")
        assert 0.0 < usage <= 1.0  # two images' rows stay cached for later requests
