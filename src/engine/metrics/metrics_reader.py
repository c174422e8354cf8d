"""A snapshot of a frontend's Prometheus families as plain dataclasses (`LLM.get_metrics()`).

Offline users (no HTTP server to scrape) read the same numbers the `PrometheusStatLogger`
publishes: `get_metrics_snapshot(registry)` walks the logger's own `CollectorRegistry` and
returns one `Counter`, `Gauge` or `Histogram` per labelled series. Names are the family names
(`ringserve:prompt_tokens`, without the `_total` suffix the text format adds), as vLLM's
`vllm.v1.metrics.reader` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.samples import Sample


@dataclass(frozen=True, slots=True)
class Counter:
    """A monotonically increasing count."""

    name: str
    labels: dict[str, str]
    value: float


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


Metric = Counter | Gauge | Histogram


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every series of `registry`, in family order."""
    result: list[Metric] = []
    for family in registry.collect():
        if family.type in ("counter", "gauge"):
            suffix = "_total" if family.type == "counter" else ""
            cls = Counter if family.type == "counter" else Gauge
            for sample in family.samples:
                if sample.name == family.name + suffix:
                    result.append(cls(family.name, dict(sample.labels), sample.value))
        elif family.type == "histogram":
            result.extend(_histograms(family.name, family.samples))
    return result


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
