"""The console's usage page, rendered on the server: bar charts as inline SVG, costs with prices, nothing a client
chose ever becomes markup."""

from __future__ import annotations

from html.parser import HTMLParser

from api.console.usage_page import amount, bar_chart, usage_page
from api.usage_report import UsageReport, UsageRow, UsageTotals

EVIL = '<script>alert("x")</script>'


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def report(group_by: str, rows: list[UsageRow], *, tenant: str = "t1", priced: bool = True) -> UsageReport:
    totals = {m: sum(getattr(r, m) for r in rows) for m in ("trained_tokens", "pool_ms")}
    return UsageReport(tenant=tenant, since="2026-03-01", until="2026-03-07", group_by=group_by,  # type: ignore[arg-type]
                       currency="EUR", rows=rows,
                       totals=UsageTotals(**totals, cost=sum(r.cost or 0 for r in rows) if priced else None))


def test_a_priced_page_charts_cost_first_and_shows_it_per_day_and_run() -> None:
    days = [UsageRow(group="2026-03-02", trained_tokens=1000, pool_ms=60_000, cost=1.5),
            UsageRow(group="2026-03-07", trained_tokens=3000, pool_ms=1_500, cost=0.25)]
    runs = [UsageRow(group=EVIL, trained_tokens=4000, pool_ms=61_500, cost=1.75)]
    html = usage_page(report("day", days), report("run", runs), caller="t1", is_admin=False, tenants=[], days=7,
                      csv_path="/api/v1/usage")
    tags = Tags()
    tags.feed(html)
    assert "script" not in [t for t, _ in tags.tags] and "&lt;script&gt;" in html
    charts = [a["data-metric"] for t, a in tags.tags if t == "figure"]
    assert charts == ["cost", "trained_tokens", "pool_ms"]  # only quantities with usage
    bars = [a for t, a in tags.tags if t == "rect"]
    assert [b["data-day"] for b in bars[:2]] == ["2026-03-02", "2026-03-07"]
    assert "1.75 EUR" in html and "1.0 min" in html and "4,000" in html
    assert "select" not in [t for t, _ in tags.tags]  # the tenant picker is for operators
    csv_links = [a["href"] for t, a in tags.tags if t == "a" and "data-csv" in a]
    assert csv_links[0] == "/api/v1/usage?since=2026-03-01&until=2026-03-07&group_by=day&format=csv"


def test_bars_are_drawn_to_scale_in_their_days_slot() -> None:
    svg = bar_chart("trained_tokens", "trained tokens", ["d1", "d2", "d3", "d4"], {"d2": 50, "d4": 100},
                    lambda v: amount("trained_tokens", v))
    tags = Tags()
    tags.feed(svg)
    bars = [a for t, a in tags.tags if t == "rect"]
    assert [b["data-day"] for b in bars] == ["d2", "d4"]
    assert float(bars[1]["height"] or 0) == 2 * float(bars[0]["height"] or 0)
    assert float(bars[0]["x"] or 0) < float(bars[1]["x"] or 0)


def test_an_operator_gets_a_tenant_picker_and_csv_links_that_name_the_tenant() -> None:
    html = usage_page(report("day", [], tenant="tabc", priced=False), report("run", [], tenant="tabc"),
                      caller="t1", is_admin=True, tenants=["t1", "tabc"], days=30, csv_path="/api/v1/usage")
    tags = Tags()
    tags.feed(html)
    options = [(a["value"], "selected" in a) for t, a in tags.tags if t == "option"]
    assert options == [("", False), ("all", False), ("tabc", True)]
    assert all("key=tabc" in str(a["href"]) for t, a in tags.tags if t == "a" and "data-csv" in a)
    assert "No usage in this range." in html
