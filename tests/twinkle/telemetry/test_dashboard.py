"""The provisioned Grafana dashboard: valid JSON with the seed's panels, each querying a metric Twinkle exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from twinkle.telemetry.naming import METRICS, prometheus_name

HERE = Path(__file__).resolve().parents[3] / "cookbook" / "observability"
DASHBOARD = HERE / "grafana" / "dashboards" / "twinkle-server-overview.json"


def exported_series() -> set[str]:
    names = set()
    for name, kind in METRICS.items():
        flat = prometheus_name(name, kind)
        names |= {f"{flat}_bucket", f"{flat}_sum", f"{flat}_count"} if kind == "histogram" else {flat}
    return names


def panels() -> list[dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "Twinkle Server Overview"
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_every_panel_query_names_a_metric_twinkle_exports() -> None:
    exported = exported_series()
    for panel in panels():
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\btwinkle_[a-z_]+", target["expr"]))
            assert used, (panel["title"], target["expr"])
            assert used <= exported, (panel["title"], used - exported)


def test_the_dashboard_has_the_seeds_panels() -> None:
    queries = " ".join(t["expr"] for p in panels() for t in p["targets"])
    titles = " ".join(p["title"] for p in panels()).lower()
    for metric in ("twinkle_http_requests_total", "twinkle_http_request_duration_seconds_bucket",
                   "twinkle_sessions_active", "twinkle_models_active", "twinkle_sampling_sessions_active",
                   "twinkle_futures_active", "twinkle_queue_depth", "twinkle_task_execution_seconds_bucket",
                   "twinkle_task_wait_seconds_bucket", "twinkle_rate_limit_rejections_total", "twinkle_tasks_total"):
        assert metric in queries, metric
    for words in ("request rate", "p95 latency", "queue depth", "execution p95", "wait p95", "rate-limit",
                  "completion status"):
        assert words in titles, words
    assert "by (le, deployment)" in queries and "by (deployment)" in queries


def test_active_gauges_are_read_as_absolute_values_never_as_rates() -> None:
    for panel in panels():
        for target in panel["targets"]:
            assert not re.search(r"(rate|increase)\(twinkle_\w+_active", target["expr"]), target["expr"]


def test_the_provider_points_at_the_folder_the_compose_file_mounts() -> None:
    provider = yaml.safe_load((HERE / "grafana" / "provisioning" / "twinkle-dashboards.yaml").read_text())
    compose = yaml.safe_load((HERE / "docker-compose.yaml").read_text())
    service = compose["services"]["lgtm"]
    assert service["image"].startswith("grafana/otel-lgtm")
    assert {"3000:3000", "4317:4317", "4318:4318"} <= set(service["ports"])
    path = provider["providers"][0]["options"]["path"]
    assert any(volume.startswith("./grafana/dashboards:" + path) for volume in service["volumes"])
    assert any("/grafana/conf/provisioning/dashboards/" in volume for volume in service["volumes"])
