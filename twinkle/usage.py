"""Exact usage metering: what each tenant's ops used, per run, base model and UTC day, kept in Redis.

A pool measures an op when it writes the op's outcome (`amounts_for`) and records it once per request id
(`UsageLedger.record`): one script marks the request counted and adds its amounts, so an SDK retry (which
the API already maps to the first request id) or a redelivered message is never counted twice.

What is charged:
- a completed op: its tokens (trained, forwarded, sampled prompt and generated), optimizer steps,
  checkpoint bytes written, and the pool time it took (`pool_ms`);
- a failed op that ran: the pool time it held, nothing else;
- an op that never ran (refused, queue timeout, lost with a crashed worker, duplicate): nothing.

Layout, per tenant `t` (all under the deployment's key prefix):
- `usage:t:day:<YYYY-MM-DD>` hash `<metric>` -> amount: the day's totals (quotas per day, the usage list);
- `usage:t:month:<YYYY-MM>` and `usage:t:total` hashes: the same summed per month and for all time;
- `usage:t:detail:<YYYY-MM-DD>` hash `<run>|<model>|<metric>` -> amount: grouping by run and by model;
- `usage:tenants` set: every tenant with usage (the admin view).
The once-only mark is a `metered` field on the future's own record, so it costs no key of its own and lives as
long as the future (a message redelivered after that is dropped unrun anyway). Day, month and detail hashes
keep 400 days; the total has no expiry. With AOF on the broker they survive restarts.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from twinkle.futures import FutureRecord, Op
from twinkle.keys import Keys
from twinkle.script_batch import ScriptCall
from twinkle.types import ForwardBackwardInput, SampleOutput, SampleRequest, input_length

# Every metered quantity, in the order reports list them.
METRICS: tuple[str, ...] = (
    "trained_tokens",  # input tokens of forward_backward
    "forwarded_tokens",  # input tokens of forward
    "sampled_prompt_tokens",  # prompt tokens of sample requests (once per request)
    "sampled_tokens",  # tokens generated, over all sequences
    "optim_steps",
    "pool_ms",  # milliseconds the op held its pool
    "checkpoint_bytes",  # bytes of checkpoints written
)
TRAIN_OPS = {Op.FORWARD_BACKWARD}
STEP_OPS = {Op.OPTIM_STEP, Op.CLIP_GRAD_AND_STEP}
SAVE_OPS = {Op.SAVE_STATE, Op.SAVE_WEIGHTS_FOR_SAMPLER, Op.SAVE_WEIGHTS_EXTERNAL}
RETENTION_SECONDS = 400 * 86400
DETAIL_SEPARATOR = "|"


def day_of(at: float) -> str:
    return _day_name(int(at // DAY_SECONDS))


def month_of(at: float) -> str:
    return _day_name(int(at // DAY_SECONDS))[:7]


DAY_SECONDS = 86400  # a UTC day (POSIX time counts no leap seconds)


@functools.lru_cache(maxsize=8)
def _day_name(day: int) -> str:
    """`YYYY-MM-DD` of the `day`-th UTC day since the epoch: formatted once a day, not for every op."""
    return datetime.fromtimestamp(day * DAY_SECONDS, UTC).strftime("%Y-%m-%d")


def period_end(period: str, at: float) -> float:
    """When the quota period holding `at` resets: the next UTC midnight or first of the month; never for total."""
    moment = datetime.fromtimestamp(at, UTC)
    if period == "day":
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        return (start + timedelta(days=1)).timestamp()
    if period == "month":
        start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        return (start.replace(year=start.year + 1, month=1) if start.month == 12
                else start.replace(month=start.month + 1)).timestamp()
    return float("inf")


def _tokens_of_native(batch: Any) -> int:
    """Input tokens of Twinkle-native inputs: a feature dict or a list of them, each with `input_ids`."""
    features = batch.get("inputs", batch) if isinstance(batch, dict) else batch
    if isinstance(features, dict):
        features = [features]
    total = 0
    for feature in features if isinstance(features, list) else []:
        ids = feature.get("input_ids") if isinstance(feature, dict) else None
        if ids is not None:
            total += len(ids)
    return total


def batch_tokens(batch: Any) -> int:
    """Input tokens of a forward / forward_backward payload, Tinker-style or Twinkle-native."""
    if isinstance(batch, ForwardBackwardInput):
        return sum(input_length(datum.model_input) for datum in batch.data)
    return _tokens_of_native(batch)


def amounts_for(op: str, payload: Any, result: Any, *, seconds: float, checkpoint_bytes: int = 0) -> dict[str, int]:
    """What one completed op used (zero amounts left out)."""
    amounts: dict[str, int] = {"pool_ms": round(seconds * 1000)}
    if op in TRAIN_OPS:
        amounts["trained_tokens"] = batch_tokens(payload)
    elif op == Op.FORWARD:
        amounts["forwarded_tokens"] = batch_tokens(payload)
    elif op in STEP_OPS:
        amounts["optim_steps"] = 1
    elif op == Op.SAMPLE:
        if isinstance(payload, SampleRequest):
            amounts["sampled_prompt_tokens"] = input_length(payload.prompt)
        if isinstance(result, SampleOutput):
            amounts["sampled_tokens"] = sum(len(seq.tokens) for seq in result.sequences)
    elif op in SAVE_OPS:
        amounts["checkpoint_bytes"] = checkpoint_bytes
    return {name: value for name, value in amounts.items() if value}


@dataclass(frozen=True)
class UsageKeys:
    """Where one deployment keeps usage (see the module docstring)."""

    keys: Keys

    def day(self, tenant: str, day: str) -> str:
        return f"{self.keys.root}usage:{tenant}:day:{day}"

    def month(self, tenant: str, month: str) -> str:
        return f"{self.keys.root}usage:{tenant}:month:{month}"

    def total(self, tenant: str) -> str:
        return f"{self.keys.root}usage:{tenant}:total"

    def detail(self, tenant: str, day: str) -> str:
        return f"{self.keys.root}usage:{tenant}:detail:{day}"

    def tenants(self) -> str:
        return f"{self.keys.root}usage:tenants"

    def period(self, tenant: str, period: str, at: float) -> str:
        """The hash a quota of `period` ("day", "month" or "total") reads at time `at`."""
        if period == "day":
            return self.day(tenant, day_of(at))
        if period == "month":
            return self.month(tenant, month_of(at))
        return self.total(tenant)

    def record_call(self, rec: FutureRecord, model: str, amounts: Mapping[str, int],
                    at: float) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the record script for one op."""
        tenant, day = rec.owner, day_of(at)
        keys = [self.keys.future(rec.request_id), self.day(tenant, day), self.month(tenant, month_of(at)),
                self.total(tenant), self.detail(tenant, day), self.tenants()]
        prefix = f"{rec.model_id}{DETAIL_SEPARATOR}{model}{DETAIL_SEPARATOR}"
        args: list[Any] = [RETENTION_SECONDS, tenant, prefix]
        for name, value in amounts.items():
            args += [name, int(value)]
        return keys, args


def decode_hash(raw: Mapping[Any, Any]) -> dict[str, int]:
    return {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}


def days_between(since: float, until: float) -> list[str]:
    """The UTC days from the one holding `since` to the one holding `until`, inclusive (at most 400)."""
    first = datetime.fromtimestamp(since, UTC).date()
    last = datetime.fromtimestamp(until, UTC).date()
    out: list[str] = []
    while first <= last and len(out) < 400:
        out.append(first.isoformat())
        first += timedelta(days=1)
    return out


def split_detail(field: str) -> tuple[str, str, str]:
    """(run, model, metric) of a detail hash field."""
    run, model, metric = field.rsplit(DETAIL_SEPARATOR, 2)
    return run, model, metric


class UsageLedger:
    """The pools' side: record each op's usage once (a sync Redis client)."""

    def __init__(self, r: Any, keys: Keys) -> None:
        self.r = r
        self.keys = UsageKeys(keys)
        self._record = r.register_script(_RECORD)

    def record(self, rec: FutureRecord, model: str, amounts: Mapping[str, int], at: float | None = None) -> bool:
        """Add the op's amounts unless this request id was counted before; True when they were added."""
        call = self.call(rec, model, amounts, at)
        return call is not None and recorded(call.script(keys=call.keys, args=call.args))

    def call(self, rec: FutureRecord, model: str, amounts: Mapping[str, int], at: float | None = None
             ) -> ScriptCall | None:
        """The script call that adds the op's amounts once (None: nothing to add); its reply read by `recorded`."""
        if not amounts:
            return None
        keys, args = self.keys.record_call(rec, model, amounts, time.time() if at is None else at)
        return ScriptCall(self._record, keys, args)

    def totals(self, tenant: str, period: str, at: float | None = None) -> dict[str, int]:
        return decode_hash(self.r.hgetall(self.keys.period(tenant, period, time.time() if at is None else at)))


def recorded(reply: Any) -> bool:
    """Whether a usage call's reply says it added the amounts (not counted before)."""
    return bool(int(reply))


def sum_amounts(rows: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rows:
        for name, value in row.items():
            out[name] = out.get(name, 0) + int(value)
    return out


def group_detail(detail: Mapping[str, int], by: str) -> dict[str, dict[str, int]]:
    """A day's detail hash (decoded) summed per run (`by="run"`) or per base model (`by="model"`)."""
    out: dict[str, dict[str, int]] = {}
    for field_name, value in detail.items():
        run, model, metric = split_detail(field_name)
        amounts = out.setdefault(run if by == "run" else model, {})
        amounts[metric] = amounts.get(metric, 0) + int(value)
    return out


def cost_of(amounts: Mapping[str, int], prices: Mapping[str, float]) -> float:
    """What `amounts` cost at `prices` (metric -> price per unit), rounded off float noise."""
    return round(sum(amounts.get(name, 0) * float(price) for name, price in prices.items()), 9)


# KEYS: the op's future, day, month, total, detail, tenants set. ARGV: retention, tenant, detail prefix, then
# metric/amount pairs. A future that is gone (expired, or lost with a broker restart) is not counted.
_RECORD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HSETNX', KEYS[1], 'metered', '1') == 0 then return 0 end
for i = 4, #ARGV, 2 do
  local name, amount = ARGV[i], tonumber(ARGV[i + 1])
  redis.call('HINCRBY', KEYS[2], name, amount)
  redis.call('HINCRBY', KEYS[3], name, amount)
  redis.call('HINCRBY', KEYS[4], name, amount)
  redis.call('HINCRBY', KEYS[5], ARGV[3] .. name, amount)
end
for _, i in ipairs({2, 3, 5}) do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
redis.call('SADD', KEYS[6], ARGV[2])
return 1
"""
