"""`GET /api/v1/usage` over real HTTP on a launched server, reading what the ledger recorded in a Redis of its own:
grouping and totals, the range of days, CSV, prices, who may read whose usage, and parameters it refuses."""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from api.usage_report import UsageAmounts
from tests.harness import LaunchedServer, free_port, mock_config
from tests.private_redis import PrivateRedis
from twinkle.auth import hash_key, tenant_id
from twinkle.futures import FutureRecord, new_request_id
from twinkle.usage import METRICS, UsageLedger

pytestmark = pytest.mark.e2e
ALICE, BOB, OPERATOR = "tml-usage-alice", "tml-usage-bob", "tml-usage-operator"
PRICES = {"trained_tokens": 0.000002, "pool_ms": 0.0001}
DAY = 86400
NOW = time.time()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[LaunchedServer]:
    """A server with two tenants, an operator and prices, on a Redis of its own (nothing else shares it)."""
    tmp = tmp_path_factory.mktemp("usage")
    broker = PrivateRedis(tmp / "redis")
    broker.start()
    config = mock_config(tiny_model_dir, tmp / "checkpoints", port=free_port(), db=0,
                         auth={"api_keys": [hash_key(ALICE), hash_key(BOB)], "admin_keys": [hash_key(OPERATOR)]})
    config["broker"]["url"] = broker.url
    config["usage"] = {"prices": PRICES, "currency": "EUR"}
    launched = LaunchedServer(config, tmp / "server.yaml", tmp / "server.log")
    launched.start()
    yield launched
    launched.stop()
    broker.kill()


@pytest.fixture
def ledger(server: LaunchedServer) -> Iterator[UsageLedger]:
    """The pools' side of the ledger on the server's Redis; every test starts with no usage recorded."""
    r = server.redis
    for key in r.scan_iter(match=server.keys.root + "usage:*"):
        r.delete(key)
    yield UsageLedger(r, server.keys)
    r.close()


def record(ledger: UsageLedger, key: str, run: str, amounts: dict[str, int], *, days_ago: float = 0,
           model: str = "tiny-qwen", request_id: str | None = None) -> FutureRecord:
    """One op of `key`'s tenant: its future as the API wrote it, then its usage as the pool records it."""
    rec = FutureRecord(request_id=request_id or new_request_id(), op="forward_backward", owner=tenant_id(key),
                       model_id=run, queue="model.models-tiny.0", status="completed")
    r: redis.Redis = ledger.r
    if not r.exists(ledger.keys.keys.future(rec.request_id)):
        r.hset(ledger.keys.keys.future(rec.request_id), mapping=rec.to_hash())
    ledger.record(rec, model, amounts, at=NOW - days_ago * DAY)
    return rec


def day(days_ago: float = 0) -> str:
    return datetime.fromtimestamp(NOW - days_ago * DAY, UTC).date().isoformat()


def usage(server: LaunchedServer, api_key: str, **params: Any) -> httpx.Response:
    return httpx.get(server.api + "/usage", params=params, headers={"X-API-Key": api_key}, timeout=30)


def report(server: LaunchedServer, api_key: str, **params: Any) -> dict[str, Any]:
    response = usage(server, api_key, **params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def amounts(row: dict[str, Any]) -> dict[str, int]:
    return {name: row[name] for name in METRICS if row[name]}


def test_a_key_sees_its_own_usage_per_day_with_totals(server: LaunchedServer, ledger: UsageLedger) -> None:
    record(ledger, ALICE, "s1:train:0", {"trained_tokens": 100, "pool_ms": 40}, days_ago=2)
    record(ledger, ALICE, "s1:train:0", {"trained_tokens": 50, "pool_ms": 10})
    record(ledger, ALICE, "s1:train:1", {"optim_steps": 1, "pool_ms": 5})
    record(ledger, BOB, "s2:train:0", {"trained_tokens": 999})
    body = report(server, ALICE)
    assert body["tenant"] == tenant_id(ALICE) and body["group_by"] == "day" and body["currency"] == "EUR"
    assert (body["since"], body["until"]) == (day(29), day(0))  # the last 30 days by default
    assert [(row["group"], amounts(row)) for row in body["rows"]] == [
        (day(2), {"trained_tokens": 100, "pool_ms": 40}),
        (day(0), {"trained_tokens": 50, "optim_steps": 1, "pool_ms": 15})]
    assert amounts(body["totals"]) == {"trained_tokens": 150, "optim_steps": 1, "pool_ms": 55}
    assert all(set(row) >= set(METRICS) and "tenant" not in row for row in body["rows"])


def test_usage_groups_by_run_and_by_model(server: LaunchedServer, ledger: UsageLedger) -> None:
    record(ledger, ALICE, "s1:train:0", {"trained_tokens": 100, "pool_ms": 40}, days_ago=3)
    record(ledger, ALICE, "s1:train:0", {"trained_tokens": 50, "pool_ms": 10})
    record(ledger, ALICE, "s1:train:1", {"forwarded_tokens": 7, "pool_ms": 5}, model="other-base")
    runs = report(server, ALICE, group_by="run")
    assert [(row["group"], amounts(row)) for row in runs["rows"]] == [
        ("s1:train:0", {"trained_tokens": 150, "pool_ms": 50}),
        ("s1:train:1", {"forwarded_tokens": 7, "pool_ms": 5})]
    models = report(server, ALICE, group_by="model")
    assert [(row["group"], amounts(row)) for row in models["rows"]] == [
        ("other-base", {"forwarded_tokens": 7, "pool_ms": 5}),
        ("tiny-qwen", {"trained_tokens": 150, "pool_ms": 50})]
    assert runs["totals"] == models["totals"] == report(server, ALICE)["totals"]


def test_since_and_until_choose_the_days_counted(server: LaunchedServer, ledger: UsageLedger) -> None:
    for days_ago in (40, 10, 5, 0):
        record(ledger, ALICE, "s1:train:0", {"trained_tokens": days_ago + 1}, days_ago=days_ago)
    assert [row["group"] for row in report(server, ALICE)["rows"]] == [day(10), day(5), day(0)]  # 30 days
    by_dates = report(server, ALICE, since=day(41), until=day(5))
    assert [row["group"] for row in by_dates["rows"]] == [day(40), day(10), day(5)]
    assert (by_dates["since"], by_dates["until"]) == (day(41), day(5))
    by_seconds = report(server, ALICE, since=str(int(NOW - 10 * DAY)), until=f"{NOW - 5 * DAY:.3f}")
    assert [row["trained_tokens"] for row in by_seconds["rows"]] == [11, 6]
    one_day = report(server, ALICE, since=day(5) + "T12:00:00Z", until=day(5) + "T13:00:00")  # naive: UTC
    assert [row["group"] for row in one_day["rows"]] == [day(5)] and one_day["since"] == one_day["until"]
    assert len(report(server, ALICE, since=day(399))["rows"]) == 4  # 400 days: the most one report covers
    assert usage(server, ALICE, since=day(400)).status_code == 400


def test_csv_has_a_header_row_and_one_line_per_group(server: LaunchedServer, ledger: UsageLedger) -> None:
    record(ledger, ALICE, "s1:train:0", {"trained_tokens": 100, "pool_ms": 40}, days_ago=1)
    record(ledger, ALICE, "s1:train:1", {"sampled_tokens": 8, "pool_ms": 20})
    response = usage(server, ALICE, format="csv", group_by="run")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/csv")
    assert "attachment" in response.headers["content-disposition"]
    lines = list(csv.reader(io.StringIO(response.text)))
    assert lines[0] == ["run", *METRICS, "cost", "currency"]
    rows = [dict(zip(lines[0], line, strict=True)) for line in lines[1:]]
    assert [(r["run"], r["trained_tokens"], r["sampled_tokens"], r["pool_ms"]) for r in rows] == [
        ("s1:train:0", "100", "0", "40"), ("s1:train:1", "0", "8", "20")]
    assert [(r["cost"], r["currency"]) for r in rows] == [("0.0042", "EUR"), ("0.002", "EUR")]


def test_prices_add_a_cost_to_every_row_and_the_totals(server: LaunchedServer, ledger: UsageLedger) -> None:
    record(ledger, ALICE, "s1:train:0", {"trained_tokens": 1_000_000, "pool_ms": 60_000, "optim_steps": 3})
    record(ledger, ALICE, "s1:train:0", {"trained_tokens": 500_000}, days_ago=1)
    body = report(server, ALICE)
    assert [row["cost"] for row in body["rows"]] == [pytest.approx(1.0), pytest.approx(2.0 + 6.0)]
    assert body["totals"]["cost"] == pytest.approx(9.0)  # optim_steps has no price: free


def test_another_tenants_usage_is_forbidden_to_a_normal_key(server: LaunchedServer, ledger: UsageLedger) -> None:
    record(ledger, BOB, "s2:train:0", {"trained_tokens": 5})
    for key in (tenant_id(BOB), "all"):
        response = usage(server, ALICE, key=key)
        assert response.status_code == 403, response.text
        body = response.json()
        assert body["category"] == "user" and body["code"] == "forbidden" and body["request_id"]
        assert "operator" in body["error"] and "Leave out `key`" in body["error"]
    assert report(server, ALICE, key=tenant_id(ALICE))["rows"] == []  # naming itself is fine
    assert usage(server, "tml-not-a-key").status_code == 401


def test_an_operator_reads_any_tenant_or_all_of_them(server: LaunchedServer, ledger: UsageLedger) -> None:
    record(ledger, ALICE, "s1:train:0", {"trained_tokens": 100, "pool_ms": 10})
    record(ledger, BOB, "s2:train:0", {"trained_tokens": 7, "pool_ms": 1}, days_ago=1)
    bob = report(server, OPERATOR, key=tenant_id(BOB))
    assert bob["tenant"] == tenant_id(BOB) and [amounts(row) for row in bob["rows"]] == [
        {"trained_tokens": 7, "pool_ms": 1}]
    everyone = report(server, OPERATOR, key="all")
    assert everyone["tenant"] == "all"
    assert [(row["group"], row["tenant"], row["trained_tokens"]) for row in everyone["rows"]] == [
        (day(1), tenant_id(BOB), 7), (day(0), tenant_id(ALICE), 100)]
    assert everyone["totals"]["trained_tokens"] == 107
    lines = list(csv.reader(io.StringIO(usage(server, OPERATOR, key="all", format="csv", group_by="run").text)))
    assert lines[0][:2] == ["tenant", "run"] and len(lines) == 3
    assert report(server, OPERATOR)["rows"] == []  # without `key`: the operator's own usage


@pytest.mark.parametrize(("params", "words"), [
    ({"group_by": "week"}, "group_by='week' is not a grouping"),
    ({"format": "xml"}, "format='xml' is not a report format"),
    ({"since": "yesterday"}, "since='yesterday' is not a date"),
    ({"until": "2026-02-30"}, "until='2026-02-30' is not a date"),
    ({"since": "nan"}, "out of range"),
    ({"until": "-5"}, "out of range"),
    ({"since": "2026-03-02", "until": "2026-03-01"}, "since (2026-03-02) is after until (2026-03-01)"),
    ({"since": "2024-01-01", "until": "2025-06-01"}, "covers 518 days; at most 400"),
])
def test_bad_parameters_answer_400_saying_what_to_fix(server: LaunchedServer, params: dict[str, str],
                                                      words: str) -> None:
    response = usage(server, ALICE, **params)
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["category"] == "user" and body["code"] == "invalid_request"
    assert words in body["error"], body["error"]


def test_an_operator_naming_something_that_is_no_tenant_gets_a_400(server: LaunchedServer) -> None:
    response = usage(server, OPERATOR, key="../etc")
    assert response.status_code == 400 and "neither a tenant id nor 'all'" in response.json()["error"]


def test_a_second_record_of_the_same_request_id_is_not_counted_twice(
        server: LaunchedServer, ledger: UsageLedger) -> None:
    first = record(ledger, ALICE, "s1:train:0", {"trained_tokens": 64, "pool_ms": 9})
    assert ledger.record(first, "tiny-qwen", {"trained_tokens": 64, "pool_ms": 9}) is False  # a redelivery
    record(ledger, ALICE, "s1:train:0", {"trained_tokens": 64, "pool_ms": 9}, request_id=first.request_id)
    body = report(server, ALICE)
    assert amounts(body["totals"]) == {"trained_tokens": 64, "pool_ms": 9}
    assert amounts(report(server, ALICE, group_by="run")["rows"][0]) == {"trained_tokens": 64, "pool_ms": 9}


def test_openapi_describes_the_report_and_its_csv(server: LaunchedServer) -> None:
    schema = httpx.get(server.base_url + "/openapi.json").json()
    operation = schema["paths"]["/api/v1/usage"]["get"]
    assert {p["name"] for p in operation["parameters"]} >= {"since", "until", "group_by", "format", "key"}
    content = operation["responses"]["200"]["content"]
    assert content["application/json"]["schema"]["$ref"].endswith("/UsageReport") and "text/csv" in content
    report_schema = schema["components"]["schemas"]["UsageReport"]["properties"]
    assert {"tenant", "since", "until", "group_by", "currency", "rows", "totals"} <= set(report_schema)
    assert set(METRICS) <= set(schema["components"]["schemas"]["UsageRow"]["properties"])


def test_the_reports_fields_are_the_ledgers_metrics_in_order() -> None:
    assert tuple(UsageAmounts.model_fields) == METRICS
