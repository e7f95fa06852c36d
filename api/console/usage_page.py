"""The console's usage page: what a key's ops used per day (bar charts drawn here as inline SVG, no script) and
per run, from the same reports `GET /api/v1/usage` answers; operators pick a tenant, or all of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import date, timedelta
from functools import partial
from urllib.parse import urlencode

from api.console.pages import esc, run_link, section, size, table
from api.usage_report import ALL, UsageReport, UsageRow, money
from twinkle.usage import METRICS

RANGES = (7, 30, 90, 400)  # days a page can show, the links above the charts
LABELS = {"trained_tokens": "trained tokens", "forwarded_tokens": "forwarded tokens",
          "sampled_prompt_tokens": "prompt tokens sampled", "sampled_tokens": "tokens sampled",
          "optim_steps": "optimizer steps", "pool_ms": "pool time", "checkpoint_bytes": "checkpoints written"}


def amount(metric: str, value: float) -> str:
    """One amount for people: token and step counts with separators, pool time as a duration, bytes as a size."""
    if metric == "pool_ms":
        seconds = value / 1000
        if seconds < 60:
            return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
        return f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"
    if metric == "checkpoint_bytes":
        return size(value)
    return f"{value:,.0f}"


def cost_text(value: float | None, currency: str) -> str:
    return "—" if value is None else f"{money(value)} {esc(currency)}"


def _metrics_used(report: UsageReport) -> list[str]:
    """The metrics with any usage in the report (all of them when there is none, so the table keeps a shape)."""
    used = [m for m in METRICS if getattr(report.totals, m)]
    return used or list(METRICS)


def _page_href(key: str | None, days: int) -> str:
    return "#/usage?" + urlencode({**({"key": key} if key else {}), "days": days})


def _csv_link(csv_path: str, key: str | None, report: UsageReport, group_by: str) -> str:
    query = urlencode({**({"key": key} if key else {}), "since": report.since, "until": report.until,
                       "group_by": group_by, "format": "csv"})
    name = f"usage-{report.tenant}-{group_by}-{report.since}-{report.until}.csv"
    return f'<a href="{esc(csv_path)}?{esc(query)}" data-csv="{esc(name)}">CSV per {esc(group_by)}</a>'


def _days(report: UsageReport) -> list[str]:
    first, last = date.fromisoformat(report.since), date.fromisoformat(report.until)
    return [(first + timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]


def bar_chart(metric: str, label: str, days: Sequence[str], values: dict[str, float],
              fmt: Callable[[float], str]) -> str:
    """One bar per day (empty days keep their slot), the largest day on top; each bar's title names its day."""
    width, height, left, right, top, bottom = 560, 180, 62, 12, 28, 26
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = max(values.values(), default=0) or 1
    slot = plot_w / max(1, len(days))
    bar_w = max(1.0, slot * 0.72)
    total = sum(values.values())
    parts = [f'<text class="chart-title" x="{left}" y="16">{esc(label)} · {esc(fmt(total))} in all</text>',
             f'<line class="grid" x1="{left}" y1="{top}" x2="{width - right}" y2="{top}"/>',
             f'<line class="axis" x1="{left}" y1="{top + plot_h}" x2="{width - right}" y2="{top + plot_h}"/>',
             f'<text x="{left - 6}" y="{top + 4}" text-anchor="end">{esc(fmt(peak))}</text>',
             f'<text x="{left - 6}" y="{top + plot_h}" text-anchor="end">0</text>']
    for i, day in enumerate(days):
        value = values.get(day, 0)
        if value <= 0:
            continue
        h = max(1.0, value / peak * plot_h)
        x = left + i * slot + (slot - bar_w) / 2
        parts.append(f'<rect class="bar" data-day="{esc(day)}" data-value="{value:g}" x="{x:.1f}" '
                     f'y="{top + plot_h - h:.1f}" width="{bar_w:.1f}" height="{h:.1f}">'
                     f'<title>{esc(day)}: {esc(fmt(value))}</title></rect>')
    if days:
        parts.append(f'<text x="{left}" y="{height - 8}">{esc(days[0])}</text>')
        parts.append(f'<text x="{width - right}" y="{height - 8}" text-anchor="end">{esc(days[-1])}</text>')
    bars = sum(1 for day in days if values.get(day, 0) > 0)
    return (f'<figure class="usage-chart" data-metric="{esc(metric)}" data-bars="{bars}">'
            f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{esc(label)} per day">{"".join(parts)}'
            '</svg></figure>')


def _per_day(report: UsageReport) -> dict[str, dict[str, float]]:
    """Each day's amounts (and cost), tenants summed (a report on all tenants has a row per tenant and day)."""
    out: dict[str, list[dict[str, float]]] = {}
    for row in report.rows:
        values: dict[str, float] = {m: getattr(row, m) for m in METRICS}
        if row.cost is not None:
            values["cost"] = row.cost
        out.setdefault(row.group, []).append(values)
    return {day: {name: sum(r.get(name, 0) for r in rows) for name in rows[0]} for day, rows in out.items()}


def _row_cells(row: UsageRow, metrics: list[str], priced: bool, currency: str) -> list[str]:
    cells = [amount(m, value) if (value := getattr(row, m)) else '<span class="empty">—</span>' for m in metrics]
    return cells + ([cost_text(row.cost, currency)] if priced else [])


def _tenant_picker(caller: str, chosen: str | None, tenants: list[str], days: int) -> str:
    options = [("", f"my key ({caller})"), (ALL, "all tenants")] + [(t, t) for t in tenants if t != caller]
    return ('<p><label>tenant <select class="usage-tenant" data-days="' + str(days) + '">'
            + "".join(f'<option value="{esc(v)}"{" selected" if v == (chosen or "") else ""}>{esc(text)}</option>'
                      for v, text in options) + "</select></label></p>")


def _charts(report: UsageReport, metrics: list[str]) -> str:
    if not report.rows:
        return '<p class="empty">No usage in this range.</p>'
    days, per_day = _days(report), _per_day(report)
    charts: list[str] = []
    if report.totals.cost is not None:
        charts.append(bar_chart("cost", f"cost ({report.currency})", days,
                                {d: v.get("cost", 0) for d, v in per_day.items()}, money))
    for m in metrics:
        charts.append(bar_chart(m, LABELS[m], days, {d: v[m] for d, v in per_day.items()},
                                partial(amount, m)))
    return f'<div class="usage-charts">{"".join(charts)}</div>'


def usage_page(by_day: UsageReport, by_run: UsageReport, *, caller: str, is_admin: bool, tenants: list[str],
               days: int, csv_path: str) -> str:
    """The whole page; `csv_path` is the API route's path (`/api/v1/usage`), `days` the range shown."""
    key = None if by_day.tenant == caller else by_day.tenant
    everyone = by_day.tenant == ALL
    priced = by_day.totals.cost is not None
    currency = by_day.currency
    whose = "all tenants" if everyone else f"tenant <code>{esc(by_day.tenant)}</code>"
    ranges = " · ".join(f"<strong>{n} days</strong>" if n == days else
                        f'<a href="{esc(_page_href(key, n))}">{n} days</a>' for n in RANGES)
    parts = [f'<h2 class="usage-title">Usage of {whose}</h2>',
             f'<p class="usage-range">UTC days {esc(by_day.since)} to {esc(by_day.until)} · show the last {ranges}</p>']
    if is_admin:
        parts.append(_tenant_picker(caller, key, tenants, days))
    links = [_csv_link(csv_path, key, by_day, g) for g in ("day", "run", "model")]
    parts.append('<p class="usage-downloads">Download: ' + " · ".join(links) + "</p>")

    metrics = _metrics_used(by_day)
    headers = [LABELS[m] for m in metrics] + (["cost"] if priced else [])
    tenant_col = ["tenant"] if everyone else []

    def lead(row: UsageRow, first: str) -> list[str]:
        return [first, *([f"<code>{esc(row.tenant)}</code>"] if everyone else []),
                *_row_cells(row, metrics, priced, currency)]

    totals = [_row_cells(UsageRow(group="", **by_day.totals.model_dump()), metrics, priced, currency)]
    parts.append(section("Totals", table(headers, totals, empty="", cls="usage-totals"), ident="usage-totals"))
    day_rows = [lead(row, esc(row.group)) for row in reversed(by_day.rows)]
    parts.append(section("Per day", _charts(by_day, metrics) + table(
        ["day", *tenant_col, *headers], day_rows, empty="", cls="usage-days"), ident="usage-days"))
    runs = sorted(by_run.rows, key=lambda r: (-(r.cost or 0), -r.pool_ms, r.group))
    run_rows = [lead(row, run_link(row.group) if row.group and key is None else f"<code>{esc(row.group or '—')}</code>")
                for row in runs]
    parts.append(section("Per run", table(["run", *tenant_col, *headers], run_rows, empty="No usage in this range.",
                                          cls="usage-runs"), ident="usage-runs"))
    return "".join(parts)
