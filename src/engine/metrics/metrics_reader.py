"""A snapshot of a frontend's Prometheus families as plain dataclasses (`LLM.get_metrics()`).

Offline users (no HTTP server to scrape) read the same numbers the `PrometheusStatLogger`
publishes: `get_metrics_snapshot(registry)` walks the logger's own `CollectorRegistry` and
returns one `Counter`, `Gauge` or `Histogram` per labelled series. Names are the family names
(`ringserve:prompt_tokens`, without the `_total` suffix the text format adds), as vLLM's
`vllm.v1.metrics.reader` does; like it, the one counter family with a `position` label,
`ringserve:spec_decode_num_accepted_tokens_per_pos`, is read as one `Vector` per engine (its
values indexed by draft position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.samples import Sample

from ringserve.engine.metrics.spec_decode import NUM_ACCEPTED_TOKENS_PER_POS


@dataclass(frozen=True, slots=True)
class Counter:
    """A monotonically increasing count."""

    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class Vector:
    """Counters indexed by position: `values[i]` is the series labelled `position="i"` (0 for a
    position not published). Only `ringserve:spec_decode_num_accepted_tokens_per_pos`."""

    name: str
    labels: dict[str, str]
    values: list[float]


@dataclass(frozen=True, slots=True)
class Gauge:
    """A value that goes up and down."""

    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class Histogram:
    """Observations in cumulative buckets.

    Attributes:
        buckets: upper bound (`le`, as text, "+Inf" last) -> observations <= it.
    """

    name: str
    labels: dict[str, str]
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)


Metric = Counter | Gauge | Histogram | Vector


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every series of `registry`, in family order."""
    result: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter" and family.name.endswith(f":{NUM_ACCEPTED_TOKENS_PER_POS}"):
            result.extend(_vectors(family.name, family.samples))
        elif family.type in ("counter", "gauge"):
            suffix = "_total" if family.type == "counter" else ""
            cls = Counter if family.type == "counter" else Gauge
            for sample in family.samples:
                if sample.name == family.name + suffix:
                    result.append(cls(family.name, dict(sample.labels), sample.value))
        elif family.type == "histogram":
            result.extend(_histograms(family.name, family.samples))
    return result


def _vectors(name: str, samples: list[Sample]) -> list[Vector]:
    by_labels: dict[tuple[tuple[str, str], ...], tuple[dict[str, str], dict[int, float]]] = {}
    for sample in samples:
        if sample.name != f"{name}_total":
            continue
        labels = dict(sample.labels)
        position = int(labels.pop("position"))
        _, values = by_labels.setdefault(tuple(sorted(labels.items())), (labels, {}))
        values[position] = sample.value
    return [Vector(name, labels, [values.get(i, 0.0) for i in range(max(values) + 1)])
            for labels, values in by_labels.values()]


@dataclass(slots=True)
class _Series:
    labels: dict[str, str]
    buckets: dict[str, int] = field(default_factory=dict)
    count: int = 0
    sum: float = 0.0


def _histograms(name: str, samples: list[Sample]) -> list[Histogram]:
    series: dict[tuple[tuple[str, str], ...], _Series] = {}
    for sample in samples:
        labels = dict(sample.labels)
        le = labels.pop("le", None)
        entry = series.setdefault(tuple(sorted(labels.items())), _Series(labels))
        if sample.name.endswith("_bucket") and le is not None:
            entry.buckets[le] = int(sample.value)
        elif sample.name.endswith("_count"):
            entry.count = int(sample.value)
        elif sample.name.endswith("_sum"):
            entry.sum = float(sample.value)
    return [Histogram(name, e.labels, e.count, e.sum, e.buckets) for e in series.values()]
