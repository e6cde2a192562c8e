"""Every metric the Grafana dashboard queries is served, on a live /metrics, by the jobs its query names.

Prometheus jobs map to the processes a Cluster starts (deploy/prometheus/local.yml): router, kvbroker,
prefill-i, decode-i, the gateway's /metrics and the launcher's own endpoint; colocated to the colocated
workers of the `colocated` fixture (tests/integration/test_colocated.py). A metric that is defined but has
no samples yet counts (tests.dashboard_queries.exposed_names reads the # TYPE lines).
"""

from __future__ import annotations

import urllib.request

from distserve.launcher import Cluster
from tests.dashboard_queries import exposed_names, load_dashboard, queries, selectors
from tests.integration.test_colocated import colocated  # noqa: F401 (the fixture, reused)

DISAGGREGATED_JOBS = {"router", "kvbroker", "prefill", "decode", "gateway", "launcher"}


def _job_urls(cluster: Cluster) -> dict[str, list[str]]:
    """The /metrics URLs of each Prometheus job in a running Cluster."""
    urls: dict[str, list[str]] = {"gateway": [cluster.gateway_url + "/metrics"], "launcher": [cluster.metrics_url]}
    for name, process in cluster.processes.items():
        if process.metrics_url:
            urls.setdefault(name.rpartition("-")[0] or name, []).append(process.metrics_url)
    return urls


def _served(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return exposed_names(reply.read().decode())


def _missing(cluster: Cluster, jobs: set[str]) -> list[str]:
    """'panel: metric (job at url)' for each metric a query selects from one of `jobs` that is not served
    at every endpoint of that job."""
    served = {job: {url: _served(url) for url in urls} for job, urls in _job_urls(cluster).items() if job in jobs}
    assert set(served) == jobs, f"no endpoints for jobs {jobs - set(served)}"
    missing = []
    for title, expr in queries(load_dashboard()):
        for selector in selectors(expr):
            for job in selector.jobs & jobs:
                missing += [f"{title}: {selector.name} ({job} at {url})"
                            for url, names in served[job].items() if selector.name not in names]
    return missing


def test_every_dashboard_metric_is_served_by_the_disaggregated_system(cluster):
    assert _missing(cluster, DISAGGREGATED_JOBS) == []


def test_every_dashboard_metric_of_colocated_workers_is_served(colocated):  # noqa: F811
    assert _missing(colocated, {"colocated"}) == []


def test_every_queried_job_is_checked():
    queried = {job for _, expr in queries(load_dashboard()) for s in selectors(expr) for job in s.jobs}
    assert queried == DISAGGREGATED_JOBS | {"colocated"}
