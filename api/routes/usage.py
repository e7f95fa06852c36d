"""What a key's ops used: `GET /usage`, as JSON or CSV, per day, run or base model (see api/usage_report.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from api.deps import Ctx, IsAdmin, Tenant
from api.usage_report import DEFAULT_DAYS, MAX_DAYS, UsageReport, build_report, csv_filename, to_csv, usage_query

router = APIRouter()
_MOMENT = "An ISO date (2026-03-01), an ISO time (2026-03-01T12:00:00Z) or unix seconds; days are UTC."
_CSV = {"description": "The report as JSON, or its rows as CSV with a header row (`format=csv`).",
        "content": {"text/csv": {"schema": {"type": "string"}}}}


@router.get("/usage", response_model=UsageReport, response_model_exclude_none=True, responses={200: _CSV},
            summary="Usage of the caller's key (operators: any tenant, or all)")
async def get_usage(
    ctx: Ctx,
    tenant: Tenant,
    admin: IsAdmin,
    since: Annotated[str | None, Query(description=f"First day counted. {_MOMENT} "
                                       f"Default: {DEFAULT_DAYS - 1} days before `until`.")] = None,
    until: Annotated[str | None, Query(description=f"Last day counted, inclusive. {_MOMENT} Default: today. "
                                       f"At most {MAX_DAYS} days from `since`.")] = None,
    group_by: Annotated[str, Query(description="`day`, `run` or `model`.")] = "day",
    fmt: Annotated[str, Query(alias="format", description="`json` or `csv`.")] = "json",
    key: Annotated[str | None, Query(description="Operators only: a tenant id, or `all` (rows then name their "
                                     "tenant). Other keys may only name their own tenant.")] = None,
) -> Any:
    query = usage_query(tenant, admin, key=key, since=since, until=until, group_by=group_by, fmt=fmt)
    report = await build_report(ctx, query)
    if query.format == "csv":
        return Response(to_csv(report), media_type="text/csv; charset=utf-8",
                        headers={"Content-Disposition": f'attachment; filename="{csv_filename(report)}"'})
    return report
