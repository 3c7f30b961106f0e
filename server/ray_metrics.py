"""Every engine replica's /metrics in one Prometheus page, each sample labelled with its
replica: what GET /metrics on the Ray Serve ingress answers.

Serve routes each call to one replica of its choice, so the ingress cannot ask every
replica for its metrics. Instead each replica publishes its page to the `MetricsBoard`
deployment (one replica) every few seconds, and the board merges the latest page of each
replica that is still publishing. The `specdec:*` and `vllm:*` names are the
single-process server's; only the `replica` label is added.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"


class _Families:
    """A prometheus_client collector over metric families parsed from text."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_pages(pages: Mapping[str, str]) -> str:
    """Prometheus text pages by replica id, as one page: one HELP/TYPE per metric, the
    samples of every replica under it with `replica` set."""
    families: dict[str, Metric] = {}
    for replica, page in sorted(pages.items()):
        for family in text_string_to_metric_families(page):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples.extend(Sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value, s.timestamp,
                                         s.exemplar) for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry).decode()


class MetricsBoard:
    """The latest metrics page of each engine replica. A page older than `stale_after`
    seconds is dropped: its replica stopped publishing (it died, or was scaled away)."""

    def __init__(self, stale_after: float) -> None:
        self.stale_after = stale_after
        self.pages: dict[str, tuple[float, str]] = {}

    def publish(self, replica: str, page: str) -> None:
        self.pages[replica] = (time.monotonic(), page)

    def withdraw(self, replica: str) -> None:
        self.pages.pop(replica, None)

    def collect(self) -> str:
        now = time.monotonic()
        self.pages = {r: (at, page) for r, (at, page) in self.pages.items() if now - at <= self.stale_after}
        return merge_pages({replica: page for replica, (_, page) in self.pages.items()})
