"""Admission control per API key and pool, from the pool's `queue_config`: requests per second, input
tokens per second (both over a sliding window) and the largest request.

The windows live in Redis: one sorted set per tenant, pool and measure, trimmed, checked and appended to
by one Lua script on the Redis clock, so the limits hold across any number of API replicas. A refused
request is not recorded, so a client that keeps hammering does not push its own window forward, and the
`Retry-After` it gets is the moment the oldest entries leave the window. The sets expire one window
after the last admitted request, so idle tenants leave nothing behind.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from twinkle.catalog import Catalog, processor_queue
from twinkle.config import QueueConfig
from twinkle.errors import InvalidRequest, RateLimited
from twinkle.keys import Keys
from twinkle.telemetry import record_rate_limit_rejection

if TYPE_CHECKING:
    from twinkle.config.apps import ModelApp, ProcessorApp, SamplerApp
    from twinkle.config.server_config import ServerConfig


@dataclass(frozen=True)
class Window:
    """`allowed` units per `seconds`; allowed 0 means unlimited."""

    allowed: float
    seconds: float

    @property
    def ms(self) -> int:
        return max(1, math.ceil(self.seconds * 1000))


def request_window(config: QueueConfig) -> Window:
    """At least one request must fit, so a rate under one per window stretches the window to 1/rate."""
    if not config.rps_limit:
        return Window(0, config.window_seconds)
    allowed = max(1, math.floor(config.rps_limit * config.window_seconds))
    return Window(allowed, allowed / config.rps_limit)


def token_window(config: QueueConfig) -> Window:
    return Window(config.tps_limit * config.window_seconds, config.window_seconds)


class RateLimiter:
    def __init__(self, r: aioredis.Redis, keys: Keys, limits: dict[str, QueueConfig],
                 queue_apps: dict[str, str]) -> None:
        self.r = r
        self.keys = keys
        self.limits = limits
        self.queue_apps = queue_apps
        self._admit = r.register_script(_ADMIT)
        self._peek = r.register_script(_PEEK)

    @classmethod
    def from_config(cls, r: aioredis.Redis, keys: Keys, config: ServerConfig, catalog: Catalog) -> RateLimiter:
        apps: list[ModelApp | SamplerApp | ProcessorApp] = [*config.model_apps(), *config.sampler_apps(),
                                                            *config.processor_apps()]
        limits = {app.name: app.args.queue_config for app in apps}
        queue_apps: dict[str, str] = {processor_queue(app.name): app.name for app in config.processor_apps()}
        for served in catalog.models.values():
            for queue in served.model_queues:
                queue_apps[queue] = served.model_app or ""
            if served.sampler_queue:
                queue_apps[served.sampler_queue] = served.sampler_app or ""
        return cls(r, keys, limits, queue_apps)

    def _config(self, queue: str) -> tuple[str, QueueConfig | None]:
        app = self.queue_apps.get(queue, queue)
        config = self.limits.get(app)
        return app, config if config is not None and config.enabled else None

    async def admit(self, owner: str, queue: str, *, input_tokens: int = 0) -> None:
        """Record one request of `owner` on `queue`, or raise: InvalidRequest for a request no window
        can ever admit, RateLimited (429, with `retry_after`) for one that fits later."""
        app, config = self._config(queue)
        if config is None:
            return
        if config.max_input_tokens and input_tokens > config.max_input_tokens:
            await self._count(app, "max_input_tokens")
            raise InvalidRequest(
                f"This request has {input_tokens} input tokens; {app} accepts at most {config.max_input_tokens} "
                "per request.", hint="Split the batch into smaller requests or shorten the sequences.",
                input_tokens=input_tokens, max_input_tokens=config.max_input_tokens)
        requests, tokens = request_window(config), token_window(config)
        if tokens.allowed and input_tokens > tokens.allowed:
            await self._count(app, "token_budget")
            raise InvalidRequest(
                f"This request has {input_tokens} input tokens, more than {app} admits per key in one window "
                f"({config.tps_limit:g} tokens/s over {config.window_seconds:g} s = {tokens.allowed:g}).",
                hint="Split the batch into smaller requests.", input_tokens=input_tokens,
                tps_limit=config.tps_limit, window_seconds=config.window_seconds)
        if not requests.allowed and not tokens.allowed:
            return
        refused, wait_ms = await self._admit(
            keys=[self.keys.rate_window(owner, app, "requests"), self.keys.rate_window(owner, app, "tokens"),
                  self.keys.rate_rejections()],
            args=[requests.ms, requests.allowed, tokens.ms, tokens.allowed, max(0, input_tokens),
                  secrets.token_hex(8), app])
        if not refused:
            return
        record_rate_limit_rejection(app, "requests" if int(refused) == 1 else "tokens")
        retry_after = max(0.001, int(wait_ms) / 1000)
        what = f"{config.rps_limit:g} requests/s" if int(refused) == 1 else f"{config.tps_limit:g} input tokens/s"
        raise RateLimited(
            f"This API key is over its rate limit of {what} on {app} (measured over "
            f"{config.window_seconds:g} s).", hint=f"Retry after {retry_after:.2f} s; the Tinker SDK does so "
            "on its own.", retry_after=retry_after, limit=what, pool=app)

    async def over_limit(self, owner: str, queue: str) -> str | None:
        """Why `owner`'s next request on `queue` would be refused now, or None if it would be admitted."""
        app, config = self._config(queue)
        if config is None:
            return None
        requests, tokens = request_window(config), token_window(config)
        if not requests.allowed and not tokens.allowed:
            return None
        full = int(await self._peek(
            keys=[self.keys.rate_window(owner, app, "requests"), self.keys.rate_window(owner, app, "tokens")],
            args=[requests.ms, requests.allowed, tokens.ms, tokens.allowed]))
        if full == 1:
            return f"this API key is over its limit of {config.rps_limit:g} requests/s on {app}"
        if full == 2:
            return f"this API key is over its limit of {config.tps_limit:g} input tokens/s on {app}"
        return None

    async def window_use(self, owner: str, app: str, requests: Window, tokens: Window,
                         now_ms: float) -> tuple[int, int]:
        """The requests and the input tokens `owner` spent on `app` within each window up to `now_ms`."""
        used = await self.r.zcount(self.keys.rate_window(owner, app, "requests"), f"({now_ms - requests.ms}", "+inf")
        entries = await self.r.zrangebyscore(self.keys.rate_window(owner, app, "tokens"),
                                             f"({now_ms - tokens.ms}", "+inf")
        spent = sum(int((e.decode() if isinstance(e, bytes) else str(e)).rpartition(":")[2] or 0) for e in entries)
        return int(used), spent

    async def _count(self, app: str, reason: str) -> None:
        record_rate_limit_rejection(app, reason)
        await self.r.hincrby(self.keys.rate_rejections(), f"{app}:{reason}", 1)


# KEYS: requests window, tokens window, rejections hash.
# ARGV: request window ms, requests allowed (0 = unlimited), token window ms, tokens allowed (0 = unlimited),
#       this request's tokens, a unique member id, the pool's name.
# Returns {0, 0} when admitted (and recorded), else {1 (requests) or 2 (tokens), ms until it would fit}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local req_ms, req_allowed = tonumber(ARGV[1]), tonumber(ARGV[2])
local tok_ms, tok_allowed = tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens = tonumber(ARGV[5])
if req_allowed > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - req_ms)
  local count = redis.call('ZCARD', KEYS[1])
  if count >= req_allowed then
    -- entries leave oldest first; one more request fits once (count - allowed + 1) of them have left
    local nth = redis.call('ZRANGE', KEYS[1], count - req_allowed, count - req_allowed, 'WITHSCORES')
    redis.call('HINCRBY', KEYS[3], ARGV[7] .. ':requests', 1)
    return {1, math.max(1, tonumber(nth[2]) + req_ms - now)}
  end
end
if tok_allowed > 0 and tokens > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tok_ms)
  local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  local used = 0
  for i = 1, #entries, 2 do used = used + tonumber(string.match(entries[i], ':(%d+)$')) end
  if used + tokens > tok_allowed then
    redis.call('HINCRBY', KEYS[3], ARGV[7] .. ':tokens', 1)
    local freed = 0
    for i = 1, #entries, 2 do
      freed = freed + tonumber(string.match(entries[i], ':(%d+)$'))
      if used - freed + tokens <= tok_allowed then return {2, math.max(1, tonumber(entries[i + 1]) + tok_ms - now)} end
    end
    return {2, tok_ms}
  end
end
if req_allowed > 0 then
  redis.call('ZADD', KEYS[1], now, ARGV[6])
  redis.call('PEXPIRE', KEYS[1], req_ms)
end
if tok_allowed > 0 and tokens > 0 then
  redis.call('ZADD', KEYS[2], now, ARGV[6] .. ':' .. ARGV[5])
  redis.call('PEXPIRE', KEYS[2], tok_ms)
end
return {0, 0}
"""

# The same windows, read only. KEYS: requests window, tokens window. ARGV: as _ADMIT's first four.
# Returns 0 when one more request would fit, 1 when the request window is full, 2 when the token window is.
_PEEK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local req_ms, req_allowed = tonumber(ARGV[1]), tonumber(ARGV[2])
local tok_ms, tok_allowed = tonumber(ARGV[3]), tonumber(ARGV[4])
if req_allowed > 0 and redis.call('ZCOUNT', KEYS[1], '(' .. (now - req_ms), '+inf') >= req_allowed then return 1 end
if tok_allowed > 0 then
  local used = 0
  local entries = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. (now - tok_ms), '+inf')
  for i = 1, #entries do used = used + tonumber(string.match(entries[i], ':(%d+)$')) end
  if used >= tok_allowed then return 2 end
end
return 0
"""
