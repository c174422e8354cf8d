"""`ringserve bench ipc`: medians and ranges over runs, every consumer reading the payload, and
(slow) a short real run that prints the like-for-like headline and the spinning ring's CPU."""

from __future__ import annotations

import json

import pytest

from ringserve.bench import ipc as bench
from ringserve.bench.ipc_peers import MAX_PAYLOAD, touch


def test_aggregate_takes_median_and_range_per_figure() -> None:
    runs = [
        {"ring": {"256": {"rt_med_us": v, "gbps": 10 * v}, "idle": {"server_pct": v / 10}}}
        for v in (3.0, 1.0, 2.0)
    ]
    medians, ranges = bench.aggregate(runs)
    assert medians == {"ring": {"256": {"rt_med_us": 2.0, "gbps": 20.0}, "idle": {"server_pct": 0.2}}}
    assert ranges["ring"]["256"] == {"rt_med_us": (1.0, 3.0), "gbps": (10.0, 30.0)}
    assert ranges["ring"]["idle"]["server_pct"] == pytest.approx((0.1, 0.3))


def test_touch_copies_every_byte() -> None:
    scratch = bytearray(MAX_PAYLOAD)
    data = bytes(range(256)) * 16
    assert touch(scratch, memoryview(data)) == len(data)
    assert scratch[: len(data)] == data
    assert touch(scratch, b"") == 0


@pytest.mark.slow
def test_short_run_reports_medians_headline_and_spin_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--iters", "40", "--bulk-bytes", "2e6", "--cpu-seconds", "0.05", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert "median of 2 runs" in out
    assert "headline (like-for-like, both park in the kernel): ring-park" in out
    assert "spinning ring (default policy) at 1 msg / 5 ms burns" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["runs"] == 2 and len(summary["per_run"]) == 2
    lo, hi = summary["range"]["zmq"]["256"]["rt_med_us"]
    assert lo <= summary["median"]["zmq"]["256"]["rt_med_us"] <= hi
    assert any(label.startswith("like-for-like") for label in summary["targets"])
