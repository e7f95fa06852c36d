"""FastAPI dependencies: the process context and the calling tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from api.context import ApiContext
from twinkle.auth import key_from_headers


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
    tenant = ctx.auth.tenant_for(key_from_headers(x_api_key, authorization))
    request.state.tenant = tenant
    return tenant


Tenant = Annotated[str, Depends(get_tenant)]
