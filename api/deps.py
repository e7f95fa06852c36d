"""FastAPI dependencies: the process context, the calling tenant and its policy (tier, weight, quotas)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from api.context import ApiContext
from twinkle.auth import key_from_headers
from twinkle.tenancy import TenantPolicy


def context_of(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


# The dependencies are coroutines although they never wait: FastAPI runs a plain function dependency in
# its thread pool, a hand-off that cost more than the rest of a refused request put together.
async def get_context(request: Request) -> ApiContext:
    return context_of(request)


Ctx = Annotated[ApiContext, Depends(get_context)]


async def get_tenant(
    request: Request,
    x_api_key: Annotated[str | None, Header()] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> str:
    ctx = context_of(request)
    tenant, policy = ctx.auth.identify(key_from_headers(x_api_key, authorization))
    request.state.tenant = tenant
    request.state.policy = policy  # resolved with the tenant id, from the same read of the keys file
    return tenant


Tenant = Annotated[str, Depends(get_tenant)]


async def get_policy(request: Request, tenant: Tenant) -> TenantPolicy:
    """The caller's policy, as `get_tenant` (run once per request) resolved it."""
    policy: TenantPolicy = request.state.policy
    return policy


Policy = Annotated[TenantPolicy, Depends(get_policy)]


async def get_is_admin(
    request: Request,
    x_api_key: Annotated[str | None, Header()] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> bool:
    """Whether the caller's key is an operator's (`auth.admin_keys`); never true in development mode."""
    return context_of(request).auth.is_admin(key_from_headers(x_api_key, authorization))


IsAdmin = Annotated[bool, Depends(get_is_admin)]
