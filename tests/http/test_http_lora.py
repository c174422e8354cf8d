"""LoRA over HTTP (issue 42, first part): a request's `model` selects an adapter of
`--lora-modules` and the response carries the adapter's name; `/v1/models` lists the adapters
under the base; `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (with
VLLM_ALLOW_RUNTIME_LORA_UPDATING), their 400s and 404s; `--lora-modules` parsing."""

from __future__ import annotations

from pathlib import Path

import pytest
from http_app_harness import MODEL, error_of, serving

from ringserve import LLM, LoRARequest, SamplingParams
from ringserve.config import LoRAConfig
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.lora.testing import peft_adapter
from ringserve.gpu.testing import tiny_model
from ringserve.http.lora_modules import parse_lora_modules
from ringserve.http.settings import ServeSettings

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 99, 342, 7, 88]


@pytest.fixture(scope="module")
def base() -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-lora")
    return {"a": peft_adapter(base, root / "a", seed=4), "b": peft_adapter(base, root / "b", seed=5)}


@pytest.fixture(scope="module")
def expected(base: Path, adapters: dict[str, Path]) -> dict[str | None, str]:
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, ignore_eos=True)
    with LLM(str(base), enable_lora=True, max_loras=2) as llm:
        out: dict[str | None, str] = {None: llm.generate(
            {"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].text}
        for i, (name, path) in enumerate(adapters.items()):
            out[name] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False,
                                     lora_request=LoRARequest(name, i + 1, str(path))
                                     )[0].outputs[0].text
    assert out["a"] != out[None] and out["b"] != out["a"]
    return out


def _settings(adapters: dict[str, Path]) -> ServeSettings:
    return ServeSettings(served_model_name=MODEL, lora_modules=(
        LoRARequest("a", 1, str(adapters["a"]), MODEL),))


async def test_model_selects_the_adapter_and_models_lists_it(
        base: Path, adapters: dict[str, Path], expected: dict[str | None, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    async with serving(base, "default", settings=_settings(adapters), enable_lora=True,
                       max_loras=2) as served:
        http = served.http
        body = {"prompt": PROMPT, "max_tokens": 8, "min_tokens": 8, "ignore_eos": True,
                "temperature": 0.0}
        for model, want in ((MODEL, expected[None]), ("a", expected["a"])):
            r = await http.post("/v1/completions", json={**body, "model": model})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            assert r.json()["choices"][0]["text"] == want
        cards = {c["id"]: c for c in (await http.get("/v1/models")).json()["data"]}
        assert cards[MODEL]["parent"] is None
        assert cards["a"]["parent"] == MODEL and cards["a"]["root"] == str(adapters["a"])
        error_of(await http.post("/v1/completions", json={**body, "model": "b"}), 404)

        r = await http.post("/v1/load_lora_adapter",
                            json={"lora_name": "b", "lora_path": str(adapters["b"])})
        assert r.status_code == 200, r.text
        r = await http.post("/v1/completions", json={**body, "model": "b"})
        assert r.json()["choices"][0]["text"] == expected["b"]
        error_of(await http.post("/v1/load_lora_adapter",
                                 json={"lora_name": "b", "lora_path": str(adapters["b"])}), 400)
        error_of(await http.post("/v1/load_lora_adapter",
                                 json={"lora_name": "c", "lora_path": "/nope"}), 400)
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 200, r.text
        error_of(await http.post("/v1/completions", json={**body, "model": "b"}), 404)
        error_of(await http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}), 404)
        # Loaded again: a new load identity, and the same tokens.
        r = await http.post("/v1/load_lora_adapter",
                            json={"lora_name": "b", "lora_path": str(adapters["b"])})
        assert r.status_code == 200
        r = await http.post("/v1/completions", json={**body, "model": "b"})
        assert r.json()["choices"][0]["text"] == expected["b"]


async def test_runtime_updating_needs_the_variable(base: Path, adapters: dict[str, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("RINGSERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    async with serving(base, "null", settings=_settings(adapters), enable_lora=True) as served:
        r = await served.http.post("/v1/load_lora_adapter",
                                   json={"lora_name": "b", "lora_path": str(adapters["b"])})
        assert r.status_code == 404


def test_lora_modules_parsing(adapters: dict[str, Path]) -> None:
    lora = LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1)
    a = str(adapters["a"])
    got = parse_lora_modules([f"x={a}", f'{{"name": "y", "path": "{a}", "base_model_name": "m"}}'],
                             lora, ["m"])
    assert [(g.lora_name, g.lora_int_id, g.base_model_name) for g in got] == [
        ("x", 1, None), ("y", 2, "m")]
    with pytest.raises(ValueError, match="--enable-lora"):
        parse_lora_modules([f"x={a}"], None, ["m"])
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules([f"x={a}", f"x={a}"], lora, ["m"])
    with pytest.raises(ValueError, match="served name"):
        parse_lora_modules([f"m={a}"], lora, ["m"])
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["nopath"], lora, ["m"])
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        parse_lora_modules(["x=/nope"], lora, ["m"])
