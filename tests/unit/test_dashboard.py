"""The Grafana dashboard is valid JSON, every panel queries something, and its SLO choices are bucket edges."""

from __future__ import annotations

import re

from prometheus_client.utils import floatToGoString

from distserve.metrics import ITL_BUCKETS, TTFT_BUCKETS
from tests.dashboard_queries import (
    PROMETHEUS_CONFIGS, Selector, load_dashboard, panels, prometheus_jobs, queries, selectors)


def test_every_panel_has_a_query_on_the_datasource_variable():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "distserve" and dashboard["title"]
    found = panels(dashboard)
    assert len(found) >= 12
    assert len({p["id"] for p in found}) == len(found), "panel ids must be unique"
    for panel in found:
        assert panel.get("targets"), f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), f"{panel['title']}: empty query {target['refId']}"
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_query_selects_metrics_of_scraped_jobs():
    compose_jobs, local_jobs = (prometheus_jobs(path) for path in PROMETHEUS_CONFIGS)
    assert compose_jobs | {"launcher"} == local_jobs  # the launcher runs only under `distserve up`
    for title, expr in queries(load_dashboard()):
        found = selectors(expr)
        assert found, f"{title}: no metric in {expr}"
        for selector in found:
            assert selector.jobs, f"{title}: {selector.name} not restricted to a job"
            assert selector.jobs <= local_jobs, f"{title}: jobs {selector.jobs - local_jobs} are not scraped"


def _variable(name: str) -> dict:
    return next(v for v in load_dashboard()["templating"]["list"] if v["name"] == name)


def test_slo_choices_are_histogram_bucket_edges():
    for name, buckets in (("slo_ttft", TTFT_BUCKETS), ("slo_tpot", ITL_BUCKETS)):
        variable = _variable(name)
        values = [option["value"] for option in variable["options"]]
        assert values == variable["query"].split(",")
        assert variable["current"]["value"] in values
        assert {float(v) for v in values} <= set(buckets), f"{name}: not bucket edges"
        for v in values:  # the le matcher finds the edge as prometheus_client writes it ("1.0") and as
            # Prometheus 3 stores it ("1")
            for written in (floatToGoString(float(v)), str(float(v)).removesuffix(".0")):
                assert re.fullmatch(f"{re.escape(v)}([.]0)?", written), (name, v, written)
    slo_queries = [expr for _, expr in queries(load_dashboard()) if "le=~" in expr]
    assert any('le=~"${slo_ttft}([.]0)?"' in expr for expr in slo_queries)
    assert any('le=~"${slo_tpot}([.]0)?"' in expr for expr in slo_queries)


def test_selectors_skip_functions_keywords_labels_ranges_and_numbers():
    expr = ('histogram_quantile(0.9, sum by (le, job) (rate(a:x_bucket{job=~"prefill|colocated", le=~"${v}"}'
            '[$__rate_interval]))) / on(instance) group_left b_total offset 5m * 1e9 > bool c{job="router"}')
    assert selectors(expr) == [Selector("a:x_bucket", frozenset({"prefill", "colocated"})),
                               Selector("b_total", None), Selector("c", frozenset({"router"}))]
