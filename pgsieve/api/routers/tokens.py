"""``/tokens``: named API tokens with roles (admin only)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, status

from pgsieve.api.deps import SessionDep
from pgsieve.api.pagination import PageDep
from pgsieve.api.schemas.security import TokenCreate, TokenCreated, TokenOut
from pgsieve.security.tokens import BOOTSTRAP_NAME, create_token, list_tokens, revoke_token

router = APIRouter(prefix="/tokens", tags=["tokens"])


@router.get("", operation_id="listTokens", response_model=list[TokenOut])
def get_tokens(session: SessionDep, page: PageDep) -> list[dict[str, Any]]:
    """Every token by name and role (never the token: only its hash is stored), after the
    bootstrap token PGSIEVE_API_TOKEN; ``limit`` per page (``Link: rel="next"``)."""
    out: list[dict[str, Any]] = [{"name": BOOTSTRAP_NAME, "role": "admin", "created_at": None,
                                  "bootstrap": True}]
    out += [{"name": t.name, "role": t.role, "created_at": t.created_at,
             "last_used_at": t.last_used_at} for t in list_tokens(session)]
    return page.of_list(out, lambda t: (0 if t.get("bootstrap") else 1, t["name"]), 2)


@router.post("", operation_id="createToken",
             status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def post_token(body: TokenCreate, session: SessionDep) -> dict[str, Any]:
    """A new token; the answer is the only place it is ever shown."""
    row, token = create_token(session, body.name, body.role)
    return {"name": row.name, "role": row.role, "created_at": row.created_at, "token": token}


@router.delete("/{name}", operation_id="revokeToken", status_code=status.HTTP_204_NO_CONTENT)
def delete_token(name: str, session: SessionDep) -> Response:
    """Revoke a token: it stops working at once."""
    revoke_token(session, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
