"""Prometheus counters, gauges and histograms kept as plain numbers, rendered at scrape time.

``prometheus_client``'s instruments are thread-safe: every ``inc`` or ``observe`` takes a
lock, a histogram walks its buckets in Python, and ``labels()`` validates its arguments on
each call. The metrics plugin updates a dozen of them per request, all on the event loop,
and the scrape (``GET /metrics``) runs on the same loop; so here a series is a dict entry
updated in place, and :class:`SeriesCollector` turns them into metric families when the
registry is collected. The text a scrape returns is the same (``_total``, ``_bucket`` with
cumulative counts and ``le``, ``_sum``, ``_count``), without ``_created`` samples.

Not thread-safe: update and collect from one thread (the event loop).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["CounterSeries", "GaugeSeries", "HistogramSeries", "SeriesCollector", "SeriesView"]

Labels = tuple[str, ...]


class _ScalarSeries:
    """A family of one value per label set (what counters and gauges share)."""

    kind = ""
    _family: type[CounterMetricFamily] | type[GaugeMetricFamily]

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.values: dict[Labels, float] = {}

    def family(self) -> Metric:
        return self.render(self.name, self.documentation, self.labelnames, self.values)

    @classmethod
    def render(
        cls, name: str, documentation: str, labelnames: list[str], values: dict[Labels, float]
    ) -> Metric:
        family = cls._family(name, documentation, labels=labelnames)
        for labels, value in values.items():
            family.add_metric(list(labels), value)
        return family


class CounterSeries(_ScalarSeries):
    """A counter family: label values -> running total."""

    kind = "counter"
    _family = CounterMetricFamily

    def inc(self, labels: Labels, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount


class GaugeSeries(_ScalarSeries):
    """A gauge family: label values -> current value."""

    kind = "gauge"
    _family = GaugeMetricFamily

    def add(self, labels: Labels, amount: float) -> None:
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount


class HistogramSeries:
    """A histogram family: label values -> per-bucket counts (not cumulative) and sum."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self._le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        #: label values -> [count of bucket 0, ..., count above the last bound, sum]
        self.values: dict[Labels, list[float]] = {}

    def _row(self, labels: Labels) -> list[float]:
        row = self.values.get(labels)
        if row is None:
            row = self.values[labels] = [0.0] * (len(self.bounds) + 2)
        return row

    def observe(self, labels: Labels, amount: float) -> None:
        row = self._row(labels)
        # The first bucket whose bound is >= amount (Prometheus' "le").
        row[bisect_left(self.bounds, amount)] += 1
        row[-1] += amount

    def observe_many(self, labels: Labels, amounts: Sequence[float]) -> None:
        if not amounts:
            return  # no series for label values that never saw an observation
        row = self._row(labels)
        bounds = self.bounds
        for amount in amounts:
            row[bisect_left(bounds, amount)] += 1
            row[-1] += amount

    def family(self) -> Metric:
        return self.render(self.name, self.documentation, self.labelnames, self.values)

    def render(
        self,
        name: str,
        documentation: str,
        labelnames: list[str],
        values: dict[Labels, list[float]],
    ) -> Metric:
        """``values`` rows laid out as :attr:`values`' (this histogram's buckets)."""
        family = HistogramMetricFamily(name, documentation, labels=labelnames)
        for labels, row in values.items():
            cumulative = 0.0
            buckets = []
            for le, count in zip(self._le, row[:-1], strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(list(labels), buckets, sum_value=row[-1])
        return family


Series = CounterSeries | GaugeSeries | HistogramSeries


class SeriesView:
    """A series under another name and label set, computed from its values when collected.

    ``project`` maps the source's label values to the view's (None leaves them out); the
    source rows that meet on one label set are summed, bucket by bucket for a histogram.
    No numbers of its own: a view cannot drift from its source (vLLM's names for our
    series, :mod:`plugins.builtin.vllm_metric_names`).
    """

    def __init__(
        self,
        source: Series,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        project: Callable[[Labels], Labels | None],
    ) -> None:
        self.source = source
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.kind = source.kind
        self._project = project

    def family(self) -> Metric:
        source = self.source
        if isinstance(source, HistogramSeries):
            rows: dict[Labels, list[float]] = {}
            for labels, row in source.values.items():
                key = self._project(labels)
                if key is None:
                    continue
                total = rows.get(key)
                if total is None:
                    rows[key] = list(row)
                else:
                    for i, count in enumerate(row):
                        total[i] += count
            return source.render(self.name, self.documentation, self.labelnames, rows)
        sums: dict[Labels, float] = {}
        for labels, value in source.values.items():
            key = self._project(labels)
            if key is not None:
                sums[key] = sums.get(key, 0.0) + value
        return source.render(self.name, self.documentation, self.labelnames, sums)


class SeriesCollector(Collector):
    """Registers the series' names with a registry and renders them when it is collected."""

    def __init__(self, series: Sequence[Series | SeriesView]) -> None:
        self._series = list(series)

    def describe(self) -> list[Metric]:
        # Empty families: the registry reserves the names (a second registration raises).
        return [Metric(s.name, s.documentation, s.kind) for s in self._series]

    def collect(self) -> Iterator[Metric]:
        for series in self._series:
            yield series.family()
