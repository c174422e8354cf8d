"""`POST /scale_elastic_dp` and `/is_scaling_elastic_dp` (issue 19 item 5) over the null model:
the admin key, bad bodies named, a scale 1 -> 2 -> 1 while streams run (none fails), a second
scale while one runs is a 409, the new engine's series on /metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio
from http_app_harness import MODEL, error_of, serving, sse_events

from ringserve.http.settings import ServeSettings

SETTINGS = ServeSettings(served_model_name=MODEL, api_key="sk-user", admin_api_key="sk-admin")
USER = {"Authorization": "Bearer sk-user"}
ADMIN = {"Authorization": "Bearer sk-admin"}


async def test_bad_bodies_and_the_admin_key(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS) as s:
        r = await s.http.post("/scale_elastic_dp", headers=USER,
                              json={"new_data_parallel_size": 2})
        assert r.status_code == 401
        for body, field in (({}, "new_data_parallel_size"),
                            ({"new_data_parallel_size": "2"}, "new_data_parallel_size"),
                            ({"new_data_parallel_size": 0}, "new_data_parallel_size"),
                            ({"new_data_parallel_size": True}, "new_data_parallel_size"),
                            ({"new_data_parallel_size": 2, "drain_timeout": -1}, "drain_timeout"),
                            ({"new_data_parallel_size": 2, "drain_timeout": "x"},
                             "drain_timeout"),
                            ({"new_data_parallel_size": 2, "shrink_first": True},
                             "shrink_first")):
            error = error_of(await s.http.post("/scale_elastic_dp", headers=ADMIN, json=body),
                             400)
            assert field in error["message"], (body, error)
        error = error_of(await s.http.post("/scale_elastic_dp", headers=ADMIN,
                                           content=b"not json"), 400)
        r = await s.http.get("/is_scaling_elastic_dp", headers=ADMIN)
        assert r.status_code == 200 and r.json() == {"is_scaling_elastic_dp": False}
        assert s.engine.data_parallel_size == 1


async def test_scale_up_and_down_while_streaming(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS) as s:
        ends: list[tuple[str | None, int]] = []
        stop = trio.Event()

        async def stream() -> None:
            while not stop.is_set():
                r = await s.http.post("/v1/completions", headers=USER, json={
                    "prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}})
                assert r.status_code == 200, r.text
                events = sse_events(r.text)
                reasons = [e["choices"][0]["finish_reason"] for e in events[:-1]
                           if e["choices"]]
                ends.append((reasons[-1], events[-2]["usage"]["completion_tokens"]))

        async def scale(size: int, out: list[httpx.Response]) -> None:
            out.append(await s.http.post("/scale_elastic_dp", headers=ADMIN,
                                         json={"new_data_parallel_size": size,
                                               "drain_timeout": 60}))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(stream)
            first: list[httpx.Response] = []
            second: list[httpx.Response] = []
            nursery.start_soon(scale, 2, first)
            with trio.fail_after(10):
                while not s.engine.is_scaling_elastic_dp:
                    await trio.sleep(0.005)
            r = await s.http.post("/is_scaling_elastic_dp", headers=ADMIN)
            assert r.json() == {"is_scaling_elastic_dp": True}
            await scale(3, second)
            error_of(second[0], 409)
            with trio.fail_after(60):
                while not first:
                    await trio.sleep(0.01)
            assert first[0].status_code == 200, first[0].text
            assert first[0].json() == {"message": "Scaled to 2 data parallel engines"}
            assert s.engine.data_parallel_size == 2
            metrics = (await s.http.get("/metrics")).text
            assert 'engine="1"' in metrics
            await trio.sleep(0.5)
            down: list[httpx.Response] = []
            await scale(1, down)
            assert down[0].status_code == 200, down[0].text
            assert down[0].json() == {"message": "Scaled to 1 data parallel engines"}
            await trio.sleep(0.3)
            stop.set()
        assert s.engine.data_parallel_size == 1
        assert ends and all(end == ("length", 40) for end in ends), ends[:5]
        health: Any = await s.http.get("/health")
        assert health.status_code == 200
