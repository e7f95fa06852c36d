"""The console's routes: one HTML shell and two static assets (no key needed: they hold no data), and the
fragments and JSON the shell's script fetches with the API key from the browser session (X-API-Key).

The key never becomes a cookie: each fragment request carries it as a header, authenticated like any API
call, so a page only ever shows the caller's own tenant, and operators (`auth.admin_keys`) see the pools too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import FileResponse, HTMLResponse

from api.console import pages
from api.console.readings import pool_readings, recent_errors, run_series, tenant_readings
from api.console.usage_page import usage_page
from api.context import ApiContext
from api.deps import Ctx, IsAdmin, Tenant
from api.responses.answer import described_by
from api.responses.console import RunMetrics
from api.services.downloads import archive_url, merged_archive_url
from api.usage_report import DEFAULT_DAYS, MAX_DAYS, build_report, tenants_with_usage, usage_query
from twinkle.auth import key_from_headers
from twinkle.checkpoints import CHECKPOINT_TYPES, CheckpointRef
from twinkle.errors import InvalidRequest, NotFound

router = APIRouter(prefix="/console", include_in_schema=False)
STATIC = Path(__file__).parent / "static"
ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}
# No inline script or style, nothing from another origin, never framed, never cached (pages hold tenant data).
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _html(body: str) -> HTMLResponse:
    return HTMLResponse(body, headers=HEADERS)


@router.get("")
@router.get("/")
async def shell() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=HEADERS)


@router.get("/static/{name}")
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise NotFound(f"No console asset {name!r}.")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers=HEADERS)


def _is_admin(ctx: ApiContext, x_api_key: str | None, authorization: str | None) -> bool:
    return ctx.auth.is_admin(key_from_headers(x_api_key, authorization))


def _downloads(ctx: ApiContext, request: Request, tenant: str) -> Any:
    """A function giving a checkpoint's signed archive URL (valid without the key, until it expires)."""
    def link(run_id: str, entry: dict[str, Any]) -> str | None:
        kind, _, name = str(entry.get("checkpoint_id", "")).partition("/")
        if kind not in CHECKPOINT_TYPES or not name:
            return None
        url, _ = archive_url(ctx, request, tenant, CheckpointRef(run_id, kind, name))  # type: ignore[arg-type]
        return url

    return link


def _merged_downloads(ctx: ApiContext, request: Request, tenant: str) -> Any:
    """A function giving the signed URL of a checkpoint's verified merged export as a tar (None: none yet)."""
    def link(run_id: str, entry: dict[str, Any]) -> str | None:
        kind, _, name = str(entry.get("checkpoint_id", "")).partition("/")
        export = entry.get("export")
        verified = isinstance(export, dict) and (export.get("merged") or {}).get("status") == "verified"
        if kind not in CHECKPOINT_TYPES or not name or not verified:
            return None
        url, _ = merged_archive_url(ctx, request, tenant, CheckpointRef(run_id, kind, name))  # type: ignore[arg-type]
        return url

    return link


@router.get("/fragments/overview")
async def overview(request: Request, ctx: Ctx, tenant: Tenant,
                   x_api_key: Annotated[str | None, Header()] = None,
                   authorization: Annotated[str | None, Header()] = None) -> HTMLResponse:
    readings = await tenant_readings(ctx, tenant)
    checkpoints = {run.model_id: list(reversed(await ctx.store.checkpoints(run.model_id))) for run in readings.runs}
    admin = ""
    if _is_admin(ctx, x_api_key, authorization):
        admin = pages.admin_section(await pool_readings(ctx), await recent_errors(ctx))
    return _html(pages.overview(readings, {k: v for k, v in checkpoints.items() if v},
                                _downloads(ctx, request, tenant), admin=admin,
                                merged_download=_merged_downloads(ctx, request, tenant)))


@router.get("/fragments/runs/{run_id}")
async def run(run_id: str, request: Request, ctx: Ctx, tenant: Tenant) -> HTMLResponse:
    record, series = await run_series(ctx, tenant, run_id)
    checkpoints = list(reversed(await ctx.store.checkpoints(run_id)))
    return _html(pages.run_page(record, series, checkpoints, _downloads(ctx, request, tenant),
                                _merged_downloads(ctx, request, tenant)))


@router.get("/api/runs/{run_id}/metrics", response_model=described_by(RunMetrics))
async def run_metrics(run_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    """The same per-step series as JSON, for scripts and notebooks."""
    record, series = await run_series(ctx, tenant, run_id)
    return {"run_id": record.model_id, "steps": record.steps,
            "series": {name: [[s, v] for s, v in points] for name, points in series.items()}}


@router.get("/fragments/usage")
async def usage(request: Request, ctx: Ctx, tenant: Tenant, admin: IsAdmin, key: str | None = None,
                days: int = DEFAULT_DAYS) -> HTMLResponse:
    """The last `days` UTC days of the caller's usage (operators: of tenant `key`, or `all`)."""
    if not 1 <= days <= MAX_DAYS:
        raise InvalidRequest(f"days={days} is out of range.", hint=f"Show 1 to {MAX_DAYS} days.")
    now = time.time()
    since, until = str(now - (days - 1) * 86400), str(now)
    by_day = await build_report(ctx, usage_query(tenant, admin, key=key, since=since, until=until))
    by_run = await build_report(ctx, usage_query(tenant, admin, key=key, since=since, until=until, group_by="run"))
    return _html(usage_page(by_day, by_run, caller=tenant, is_admin=admin, days=days,
                            tenants=await tenants_with_usage(ctx) if admin else [],
                            csv_path=request.app.url_path_for("get_usage")))
