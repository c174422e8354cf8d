"""Elastic DP in a scaled-out deployment (issue 19 item 5): `ringserve serve -asc 2 -dp 1`,
scaled 1 -> 2 -> 1 through `POST /scale_elastic_dp` while streams run on both API servers:
every stream is the greedy text of its prompt (none fails), the supervisor runs two cores and
then one again, the new core's series reach /metrics, and a refused scale changes nothing."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from test_http_server import ADMIN_KEY, LiveServer, _auth
from test_scaleout_server import PROMPTS, _body, _expected_texts, _processes, _stream_text

pytestmark = pytest.mark.slow

FLAGS = ("--data-parallel-size", "1", "--api-server-count", "2", "--admin-api-key", ADMIN_KEY,
         "--max-num-seqs", "64", "--shutdown-timeout", "30")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from ringserve.gpu.testing import tiny_model

    return tiny_model("llama")


async def _scale(client: httpx.AsyncClient, size: int) -> httpx.Response:
    return await client.post("/scale_elastic_dp", headers=_auth(ADMIN_KEY),
                             json={"new_data_parallel_size": size, "drain_timeout": 60})


async def _cores(live: LiveServer, count: int) -> None:
    with trio.fail_after(20):
        while len(_processes(live).get("core", [])) != count:
            await trio.sleep(0.05)


async def test_scale_up_and_down_across_two_api_servers(model_dir: Path,
                                                        tmp_path: Path) -> None:
    live = LiveServer(model_dir, tmp_path / "server.log", FLAGS)
    live.cmd.remove("--disable-log-stats")  # /metrics is checked
    with live:
        kinds = _processes(live)
        assert len(kinds["core"]) == 1 and "frontend1" in kinds
        # Two API servers have the DP coordinator from the start (issue 19 item 2), so the
        # scaled-up cores' loads reach both.
        assert len(kinds["coordinator"]) == 1
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as client:
            expected = await _expected_texts(client)
            results: list[tuple[str, str, int, str]] = []
            stop = trio.Event()

            async def streams(worker: int) -> None:
                i = worker
                while not stop.is_set():
                    prompt = PROMPTS[i % len(PROMPTS)]
                    text, events, finish = await _stream_text(client, _body(prompt, 8))
                    results.append((prompt, text, events, finish))
                    i += 1

            refused = await client.post("/scale_elastic_dp", headers=_auth(ADMIN_KEY),
                                        json={"new_data_parallel_size": 0})
            assert refused.status_code == 400, refused.text
            with trio.fail_after(240):
                async with trio.open_nursery() as nursery:
                    for worker in range(8):
                        nursery.start_soon(streams, worker)
                    await trio.sleep(1.0)
                    up = await _scale(client, 2)
                    assert up.status_code == 200, (up.text, live.output()[-3000:])
                    assert up.json() == {"message": "Scaled to 2 data parallel engines"}
                    await _cores(live, 2)
                    served_at_two = len(results)
                    await trio.sleep(2.0)
                    metrics = (await client.get("/metrics")).text
                    down = await _scale(client, 1)
                    assert down.status_code == 200, (down.text, live.output()[-3000:])
                    await _cores(live, 1)
                    await trio.sleep(1.0)
                    stop.set()
            assert len(results) > served_at_two > 0
            bad = [r for r in results if r[3] != "length" or r[1] != expected[r[0]]]
            assert not bad, (bad[:3], live.output()[-3000:])
            assert 'engine="1"' in metrics
            health = await client.get("/health")
            assert health.status_code == 200
            # Scaled back: one core serves, a second scale-up works again.
            again = await _scale(client, 2)
            assert again.status_code == 200, again.text
            await _cores(live, 2)
            text, _events, finish = await _stream_text(client, _body(PROMPTS[0], 8))
            assert (text, finish) == (expected[PROMPTS[0]], "length")
