"""Usage reports (`GET /api/v1/usage` and the console's usage page), read from the ledger the pools write.

The ledger (twinkle/usage.py) keeps per tenant and UTC day one hash of totals and one of `run|model|metric`
details; a report sums those hashes over a range of days, per day, per run or per base model, and prices them
with `usage.prices`. A key reads its own tenant; an operator key may name another tenant, or `all`.
"""

from __future__ import annotations

import csv
import io
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from api.context import ApiContext
from twinkle.errors import Forbidden, InvalidRequest
from twinkle.usage import METRICS, cost_of, days_between, group_detail, sum_amounts

GroupBy = Literal["day", "run", "model"]
GROUPS: tuple[GroupBy, ...] = ("day", "run", "model")
FORMATS = ("json", "csv")
ALL = "all"
MAX_DAYS = 400  # as long as the ledger keeps day and detail hashes
DEFAULT_DAYS = 30
LATEST = 253402300799.0  # 9999-12-31T23:59:59Z
_TENANT_ID = re.compile(r"t[0-9a-f]{20}")
_MOMENT_HINT = "Use an ISO date (2026-03-01), an ISO time (2026-03-01T12:00:00Z) or unix seconds."


class _RowKey(BaseModel):
    group: str = Field(description="The UTC day (YYYY-MM-DD), run id or base model this row sums.")
    tenant: str | None = Field(default=None, description="The tenant, when the report covers all tenants.")


class UsageAmounts(BaseModel):
    """Every metered quantity (`twinkle.usage.METRICS`), in report order."""

    trained_tokens: int = Field(default=0, description="Input tokens of forward_backward.")
    forwarded_tokens: int = Field(default=0, description="Input tokens of forward.")
    sampled_prompt_tokens: int = Field(default=0, description="Prompt tokens of sample requests.")
    sampled_tokens: int = Field(default=0, description="Tokens generated, over all sequences.")
    optim_steps: int = Field(default=0, description="Optimizer steps.")
    pool_ms: int = Field(default=0, description="Milliseconds ops held their pool (failed ops that ran too).")
    checkpoint_bytes: int = Field(default=0, description="Bytes of checkpoints written.")


class UsageRow(UsageAmounts, _RowKey):
    cost: float | None = Field(default=None, description="Priced with `usage.prices` (absent without prices).")


class UsageTotals(UsageAmounts):
    cost: float | None = Field(default=None, description="Priced with `usage.prices` (absent without prices).")


class UsageReport(BaseModel):
    tenant: str = Field(description="The tenant reported on, or `all`.")
    since: str = Field(description="The first UTC day counted (YYYY-MM-DD).")
    until: str = Field(description="The last UTC day counted, inclusive.")
    group_by: GroupBy
    currency: str = Field(description="The unit of every cost (`usage.currency`).")
    rows: list[UsageRow]
    totals: UsageTotals


@dataclass(frozen=True)
class UsageQuery:
    tenant: str  # a tenant id, or ALL
    days: list[str]  # the UTC days covered, oldest first
    group_by: GroupBy
    format: str = "json"


def parse_moment(value: str, name: str) -> float:
    """Unix seconds of `value`: unix seconds, an ISO date (its UTC midnight) or an ISO time (UTC if naive)."""
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise InvalidRequest(f"{name}={value!r} is not a date or a time.", hint=_MOMENT_HINT) from None
        moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
        try:
            seconds = moment.timestamp()
        except (OverflowError, ValueError, OSError):
            seconds = -1.0
    if not 0 <= seconds <= LATEST:  # NaN too
        raise InvalidRequest(f"{name}={value!r} is out of range.", hint=_MOMENT_HINT)
    return seconds


def usage_days(since: str | None, until: str | None, now: float | None = None) -> list[str]:
    """The UTC days from `since` to `until` inclusive; by default the last DEFAULT_DAYS days up to today."""
    end = parse_moment(until, "until") if until is not None else time.time() if now is None else now
    start = parse_moment(since, "since") if since is not None else max(0.0, end - (DEFAULT_DAYS - 1) * 86400)
    if start > end:
        raise InvalidRequest(f"since ({_day(start)}) is after until ({_day(end)}).",
                             hint="Give since before until, or leave one of them out.")
    count = (datetime.fromtimestamp(end, UTC).date() - datetime.fromtimestamp(start, UTC).date()).days + 1
    if count > MAX_DAYS:
        raise InvalidRequest(f"The range {_day(start)} to {_day(end)} covers {count} days; at most {MAX_DAYS} "
                             "can be asked for at once.", hint=f"Usage is kept {MAX_DAYS} days: ask for a "
                             "shorter range, or several.")
    return days_between(start, end)


def _day(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).date().isoformat()


def usage_query(caller: str, is_admin: bool, *, key: str | None = None, since: str | None = None,
                until: str | None = None, group_by: str = "day", fmt: str = "json") -> UsageQuery:
    """Check who asks for what and the parameters; InvalidRequest (400) or Forbidden (403) when wrong."""
    tenant = caller if key is None or key.strip() in ("", caller) else key.strip()
    if tenant != caller:
        if not is_admin:
            raise Forbidden("Only an operator key can read another tenant's usage.",
                            hint="Leave out `key` to read your own; operators' keys are listed in auth.admin_keys.")
        if tenant != ALL and not _TENANT_ID.fullmatch(tenant):
            raise InvalidRequest(f"key={tenant!r} is neither a tenant id nor {ALL!r}.",
                                 hint="A tenant id is 't' and 20 hex digits, as reports and the console show it.")
    if group_by not in GROUPS:
        raise InvalidRequest(f"group_by={group_by!r} is not a grouping.", hint="Use one of: " + ", ".join(GROUPS) + ".")
    if fmt not in FORMATS:
        raise InvalidRequest(f"format={fmt!r} is not a report format.", hint="Use json or csv.")
    return UsageQuery(tenant, usage_days(since, until), group_by, fmt)  # type: ignore[arg-type]


async def tenants_with_usage(ctx: ApiContext) -> list[str]:
    """Every tenant the ledger has seen (for operators)."""
    return await ctx.usage_history.tenants()


async def _grouped(ctx: ApiContext, tenant: str, days: list[str], group_by: GroupBy) -> dict[str, dict[str, int]]:
    """One tenant's amounts per group, groups in order (days oldest first, runs and models by name)."""
    replies = await ctx.usage_history.per_day(tenant, days, details=group_by != "day")
    if group_by == "day":
        return {day: amounts for day, amounts in zip(days, replies, strict=True) if amounts}
    merged: dict[str, list[dict[str, int]]] = {}
    for detail in replies:
        for group, amounts in group_detail(detail, group_by).items():
            merged.setdefault(group, []).append(amounts)
    return {group: sum_amounts(merged[group]) for group in sorted(merged)}


def _amounts(amounts: dict[str, int]) -> dict[str, int]:
    return {name: int(amounts.get(name, 0)) for name in METRICS}


async def build_report(ctx: ApiContext, query: UsageQuery) -> UsageReport:
    usage = ctx.config.usage
    prices = dict(usage.prices)
    tenants = await tenants_with_usage(ctx) if query.tenant == ALL else [query.tenant]
    rows: list[UsageRow] = []
    for tenant in tenants:
        for group, amounts in (await _grouped(ctx, tenant, query.days, query.group_by)).items():
            rows.append(UsageRow(group=group, tenant=tenant if query.tenant == ALL else None, **_amounts(amounts),
                                 cost=cost_of(amounts, prices) if prices else None))
    if query.tenant == ALL and query.group_by == "day":
        rows.sort(key=lambda row: (row.group, row.tenant or ""))
    totals = _amounts(sum_amounts(row.model_dump(include=set(METRICS)) for row in rows))
    return UsageReport(tenant=query.tenant, since=query.days[0], until=query.days[-1], group_by=query.group_by,
                       currency=usage.currency, rows=rows,
                       totals=UsageTotals(**totals, cost=cost_of(totals, prices) if prices else None))


def to_csv(report: UsageReport) -> str:
    """The rows as CSV with a header row: [tenant,] <group_by>, every metric[, cost, currency]."""
    everyone = report.tenant == ALL
    priced = report.totals.cost is not None
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow([*(["tenant"] if everyone else []), report.group_by, *METRICS,
                     *(["cost", "currency"] if priced else [])])
    for row in report.rows:
        values: list[Any] = [getattr(row, name) for name in METRICS]
        writer.writerow([*([row.tenant] if everyone else []), row.group, *values,
                         *([money(row.cost or 0.0), report.currency] if priced else [])])
    return out.getvalue()


def money(amount: float) -> str:
    """A cost in plain decimal notation (never 2e-06), to the 9 digits costs are rounded to."""
    return f"{amount:.9f}".rstrip("0").rstrip(".") or "0"


def csv_filename(report: UsageReport) -> str:
    return f"usage-{report.tenant}-{report.group_by}-{report.since}-{report.until}.csv"
