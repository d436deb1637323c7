"""Prometheus: the figures fanout keeps in its rows, for a scrape.

``metrics_view`` serves them to staff users and to ``Authorization: Bearer <FANOUT_METRICS_TOKEN>``;
``FanoutCollector`` adds them to a prometheus_client registry of your own, beside django-rq's
``RQCollector`` for instance. Both need the ``prometheus`` extra (prometheus-client).

- ``fanout_items{definition, status}``: items of open runs (0 for a status none is in).
- ``fanout_pool_in_flight{pool}`` and ``fanout_pool_limit{pool}``: items of each pool running
  now, across every run and host, and the pool's max_concurrency.
- ``fanout_counter_drift_total{kind, name}``: in-flight counters the supervisor's audit found
  different from their rows and corrected, each pool's (``kind="pool"``) and runs' by definition
  (``kind="run"``), as recorded on the rows. Anything but 0 is a bug worth reporting.
- ``fanout_budget_spent``, ``fanout_budget_reserved`` and ``fanout_budget_limit`` ``{kind, name,
  unit}``: each pool's budget and each open run's (fanout.spend), by unit.

Claim latency is measured in each worker process, not in the rows: it is the OpenTelemetry
histogram ``fanout.claim.duration`` (see fanout.telemetry).
"""

from __future__ import annotations

from collections.abc import Iterator
from hmac import compare_digest
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, HttpResponseForbidden
from django.views.decorators.cache import never_cache

from .conf import conf
from .telemetry import budget_figures, drift_figures, item_counts, pool_figures, read_rows


class FanoutCollector:
    """A prometheus_client collector that reads fanout's rows on each scrape (four queries)."""

    def describe(self) -> list[Any]:
        return []  # nothing to read when it is registered

    def collect(self) -> Iterator[Any]:
        yield _items()
        yield from _pools()
        yield _drift()
        yield from _budgets()


# prometheus_client is an extra: it is imported when a scrape reads the figures.


def _items() -> Any:
    from prometheus_client.core import GaugeMetricFamily

    items = GaugeMetricFamily(
        "fanout_items",
        "Items of open runs, by definition and status.",
        labels=["definition", "status"],
    )
    for (definition, status), n in sorted(read_rows(item_counts, {}).items()):
        items.add_metric([definition, status], n)
    return items


def _pools() -> list[Any]:
    from prometheus_client.core import GaugeMetricFamily

    in_flight = GaugeMetricFamily(
        "fanout_pool_in_flight",
        "Items of each pool running now, across every run and host.",
        labels=["pool"],
    )
    limit = GaugeMetricFamily("fanout_pool_limit", "Each pool's max_concurrency.", labels=["pool"])
    for name, running, max_concurrency in read_rows(pool_figures, []):
        in_flight.add_metric([name], running)
        limit.add_metric([name], max_concurrency)
    return [in_flight, limit]


def _drift() -> Any:
    from prometheus_client.core import CounterMetricFamily

    drift = CounterMetricFamily(
        "fanout_counter_drift",
        "In-flight counters found different from their rows and corrected by the audit.",
        labels=["kind", "name"],
    )
    for kind, name, n in read_rows(drift_figures, []):
        drift.add_metric([kind, name], n)
    return drift


def _budgets() -> list[Any]:
    from prometheus_client.core import GaugeMetricFamily

    budgets = {
        name: GaugeMetricFamily(f"fanout_budget_{name}", help_text, labels=["kind", "name", "unit"])
        for name, help_text in (
            ("spent", "What each budget's items spent (a pool's: in its period)."),
            ("reserved", "Estimates held against each budget by items running now."),
            ("limit", "Each budget: a pool's, and an open run's max_spend."),
        )
    }
    for kind, name, unit, spent, reserved, budget in read_rows(budget_figures, []):
        budgets["spent"].add_metric([kind, name, unit], spent)
        budgets["reserved"].add_metric([kind, name, unit], reserved)
        budgets["limit"].add_metric([kind, name, unit], budget)
    return list(budgets.values())


def allowed(request: HttpRequest) -> bool:
    """Staff users, or a request that shows FANOUT_METRICS_TOKEN as its bearer token."""
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        return True
    token = conf.METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    if not token or not header.startswith("Bearer "):
        return False
    return compare_digest(header.removeprefix("Bearer ").strip().encode(), str(token).encode())


@never_cache
def metrics_view(request: HttpRequest) -> HttpResponse:
    """fanout's metrics in Prometheus's text format (or OpenMetrics, if the scraper asks)."""
    if not allowed(request):
        return HttpResponseForbidden("staff users or FANOUT_METRICS_TOKEN only\n")
    try:
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import choose_encoder
    except ImportError:
        missing = "prometheus-client is missing: pip install 'django-batch-fanout[prometheus]'"
        raise Http404(missing) from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FanoutCollector())  # type: ignore[arg-type]
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(registry), content_type=content_type)
