"""HTML fragments of the console, rendered on the server from the readings.

Every value that came from a client (ids, names, metadata, error messages) goes through `esc`; the chart
data travels as JSON in an attribute and is drawn by static/console.js, so no page carries inline script.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import quote

from api.console.readings import PoolReading, TenantReadings
from twinkle.records import ModelRecord


def esc(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def when(ts: float | str | None) -> str:
    if not ts:
        return "—"
    if isinstance(ts, str):
        return esc(ts.replace("T", " ")[:19])
    return datetime.fromtimestamp(float(ts), UTC).strftime("%Y-%m-%d %H:%M:%S")


def size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "—"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, empty: str, cls: str = "") -> str:
    """`rows` cells are HTML already (escaped by the caller)."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="empty">{esc(empty)}</p>'
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    return f'<table class="{esc(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def section(title: str, inner: str, *, ident: str) -> str:
    return f'<section id="{esc(ident)}"><h2>{esc(title)}</h2>{inner}</section>'


def status_badge(status: str) -> str:
    return f'<span class="badge badge-{esc(status)}">{esc(status)}</span>'


def run_link(run_id: str) -> str:
    return f'<a href="#/runs/{quote(run_id, safe="")}" data-run="{esc(run_id)}">{esc(run_id)}</a>'


Link = Callable[[str, dict[str, Any]], str | None]


def export_cell(entry: dict[str, Any], merged_link: str | None) -> str:
    """A checkpoint's merged export (twinkle.merged_export): its check's largest logprob difference, and the
    merged model's download once verified."""
    export = entry.get("export")
    if not isinstance(export, dict):
        return "—"
    status = str(export.get("status", ""))
    adapter, merged = export.get("adapter") or {}, export.get("merged") or {}
    detail = (f"PEFT adapter: max |Δ logprob| {_num(adapter.get('max_abs_diff'))} ({adapter.get('status', '—')}); "
              + (f"merged model: {_num(merged.get('max_abs_diff'))} ({merged.get('status', '—')}); " if merged
                 else "not merged yet; ")
              + f"tolerance {_num(export.get('tolerance'))}")
    cell = (f'<span class="export" title="{esc(detail)}">{status_badge(status)} {"" if merged else "adapter "}'
            f'max |Δ| {esc(_num(export.get("max_abs_diff")))}</span>')
    if merged_link and merged.get("status") == "verified":
        cell += f' <a href="{esc(merged_link)}" download>merged model</a> ({size(merged.get("size_bytes"))})'
    return cell


def _num(value: Any) -> str:
    return f"{value:.2g}" if isinstance(value, (int, float)) else "—"


def overview(readings: TenantReadings, checkpoints: dict[str, list[dict[str, Any]]],
             download: Link, *, admin: str = "", merged_download: Link | None = None) -> str:
    parts = [f'<p class="who">Signed in as tenant <code>{esc(readings.tenant)}</code>'
             f'{" (operator)" if admin else ""}.</p>', admin]
    parts.append(section("Training runs", runs_table(readings.runs), ident="runs"))
    ops = [[f"<code>{esc(p.record.request_id)}</code>", esc(p.record.op), status_badge(p.record.status),
            esc(p.record.queue), "—" if p.position is None else str(p.position),
            esc(p.record.model_id) or "—", when(p.record.created_at),
            esc(p.record.error) if p.record.error else ""] for p in readings.ops]
    parts.append(section("Recent operations", table(
        ["request", "op", "status", "queue", "ahead in queue", "model", "submitted", "error"], ops,
        empty="No operations yet.", cls="ops"), ident="ops"))
    rows = []
    for run_id, entries in checkpoints.items():
        for c in entries:
            link = download(run_id, c)
            rows.append([run_link(run_id), f"<code>{esc(c.get('tinker_path'))}</code>", esc(c.get("checkpoint_type")),
                         size(c.get("size_bytes")), when(c.get("time")), expiry(c.get("expires_at")),
                         f'<a href="{esc(link)}" download>download</a>' if link else "—",
                         export_cell(c, merged_download(run_id, c) if merged_download else None)])
    headers = ["run", "path", "type", "size", "saved", "TTL", "", "merged export"]
    parts.append(section("Checkpoints", table(headers, rows, empty="No checkpoints yet.", cls="checkpoints"),
                         ident="checkpoints"))
    sessions = [[f"<code>{esc(s.session_id)}</code>", when(s.created_at), when(s.last_heartbeat),
                 esc(s.finished) or "open", esc(s.sdk_version) or "—"] for s in readings.sessions]
    parts.append(section("Sessions", table(["session", "created", "last heartbeat", "state", "client"], sessions,
                                           empty="No sessions.", cls="sessions"), ident="sessions"))
    samplers = [[f"<code>{esc(s.sampling_session_id)}</code>", esc(s.base_model),
                 f"<code>{esc(s.model_path)}</code>" if s.model_path else "base model", when(s.created_at)]
                for s in readings.sampling_sessions]
    parts.append(section("Sampler sessions", table(["sampler", "base model", "weights", "created"], samplers,
                                                   empty="No sampler sessions.", cls="samplers"), ident="samplers"))
    rates = [[esc(u.pool), f"{u.requests} / {u.requests_allowed:g}" if u.requests_allowed else "unlimited",
              f"{u.tokens} / {u.tokens_allowed:g}" if u.tokens_allowed else "unlimited", f"{u.window_seconds:g} s"]
             for u in readings.rates]
    parts.append(section("Rate limits", table(["pool", "requests in window", "input tokens in window", "window"],
                                              rates, empty="No rate limits apply to this key.", cls="rates"),
                         ident="rates"))
    return "".join(parts)


def runs_table(runs: list[ModelRecord]) -> str:
    rows = [[run_link(r.model_id), esc(r.base_model), status_badge(r.status) + (
        f' <span class="reason">{esc(r.unload_reason)}</span>' if r.unload_reason else ""),
        str(r.steps), str(r.lora.get("rank", "—")), when(r.last_request_at or r.created_at),
        f"<code>{esc(r.last_checkpoint)}</code>" if r.last_checkpoint else "—"] for r in runs]
    return table(["run", "base model", "status", "steps", "rank", "last request", "last checkpoint"], rows,
                 empty="No training runs yet.", cls="runs")


def expiry(expires_at: Any) -> str:
    if not expires_at:
        return "kept"
    try:
        left = datetime.fromisoformat(str(expires_at)).timestamp() - datetime.now(UTC).timestamp()
    except ValueError:
        return esc(expires_at)
    if left <= 0:
        return "expired"
    return f"{left / 3600:.1f} h left" if left >= 3600 else f"{left / 60:.0f} min left"


def run_page(run: ModelRecord, series: dict[str, list[tuple[int, float]]], checkpoints: list[dict[str, Any]],
             download: Link, merged_download: Link | None = None) -> str:
    default = next((n for n in ("loss:sum", "loss:mean", "loss") if n in series),
                   next((n for n in series if "loss" in n), next(iter(series), "")))
    data = esc(json.dumps({"series": series, "default": default}, separators=(",", ":")))
    options = "".join(f'<option value="{esc(n)}"{" selected" if n == default else ""}>{esc(n)}</option>'
                      for n in series)
    chart = (f'<figure class="chart" data-chart="{data}"><figcaption>'
             f'<label>metric <select class="metric">{options}</select></label></figcaption>'
             '<div class="plot"></div></figure>') if series else '<p class="empty">No metrics recorded yet.</p>'
    steps = sorted({s for points in series.values() for s, _ in points})[-20:]
    names = list(series)[:6]
    values = {n: dict(series[n]) for n in names}
    recent = [[str(s), *(f"{values[n][s]:.4g}" if s in values[n] else "" for n in names)] for s in reversed(steps)]
    rows = [[f"<code>{esc(c.get('tinker_path'))}</code>", esc(c.get("checkpoint_type")), size(c.get("size_bytes")),
             when(c.get("time")), expiry(c.get("expires_at")),
             f'<a href="{esc(link)}" download>download</a>' if (link := download(run.model_id, c)) else "—",
             export_cell(c, merged_download(run.model_id, c) if merged_download else None)]
            for c in checkpoints]
    return (f'<p><a href="#/">← all runs</a></p><h2 class="run-title">Run <code>{esc(run.model_id)}</code></h2>'
            f'<p class="run-facts">{status_badge(run.status)} base model {esc(run.base_model)} · '
            f'{run.steps} steps · LoRA rank {esc(run.lora.get("rank", "—"))} · created {when(run.created_at)}</p>'
            + section("Metrics per step", chart + table(["step", *names], recent, empty="", cls="metrics"),
                      ident="metrics")
            + section("Checkpoints", table(["path", "type", "size", "saved", "TTL", "", "merged export"], rows,
                                           empty="No checkpoints yet.", cls="checkpoints"), ident="run-checkpoints"))


def admin_section(pools: list[PoolReading], errors: list[dict[str, Any]]) -> str:
    rows = [[f"<code>{esc(p.queue)}</code>", esc(p.kind), status_badge("ready" if p.ready else "down"),
             str(p.depth), "—" if p.resident is None else f"{p.resident} / {p.max_loras}",
             "—" if p.assigned is None else str(max(0, p.assigned - (p.resident or 0)))] for p in pools]
    errs = [[when(e.get("t")), f"<code>{esc(e.get('queue'))}</code>", esc(e.get("op")), esc(e.get("category")),
             esc(e.get("code")), f"<code>{esc(e.get('owner'))}</code>", esc(e.get("error"))] for e in errors]
    return (section("Pools (operator)", table(["queue", "kind", "state", "queue depth", "adapters resident / slots",
                                               "adapters paged out"], rows, empty="No pools.", cls="pools"),
                    ident="pools")
            + section("Recent errors (operator)", table(["time", "queue", "op", "category", "code", "tenant",
                                                         "message"], errs, empty="No errors.", cls="errors"),
                      ident="errors"))
