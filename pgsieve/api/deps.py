"""FastAPI dependencies: settings, metadata session, authorization by role, lookups.

Authentication happens before routing, in :mod:`pgsieve.api.security` (so a request
without a valid token is refused before its body is read); :func:`authorize`, on every
``/api/v1`` route, checks the caller's role against :data:`pgsieve.api.roles.ROLE_MATRIX`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from pgsieve.api.roles import required_role
from pgsieve.platform.credentials import SecretBox
from pgsieve.platform.errors import ErrorCode, PgsieveError
from pgsieve.platform.settings import Settings
from pgsieve.security.tokens import Principal, Role

_bearer = HTTPBearer(
    auto_error=False,
    description="PGSIEVE_API_TOKEN (the bootstrap admin token) or a token from "
                "`pgsieve token create` / `POST /api/v1/tokens`",
)


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    session: Session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        session.close()


def get_secret_box(request: Request) -> SecretBox:
    """The app's credential box, made on first use: it reads the deployment's salt from
    the metadata store, which need not be migrated yet when the API starts."""
    box: SecretBox | None = request.app.state.secret_box
    if box is None:
        settings: Settings = request.app.state.settings
        box = request.app.state.secret_box = settings.secret_box()
    return box


def unauthorized() -> PgsieveError:
    return PgsieveError(
        "a valid 'Authorization: Bearer <token>' header is required",
        code=ErrorCode.UNAUTHORIZED,
        status=401,
        title="Unauthorized",
    )


def current_principal(request: Request) -> Principal:
    """Who is calling (set by the authentication middleware)."""
    principal = request.scope.get("state", {}).get("principal")
    if not isinstance(principal, Principal):
        raise unauthorized()
    return principal


def authorize(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The one authorization check: the caller's role against the route's in the matrix
    (403 ``forbidden`` when it is lower)."""
    principal = current_principal(request)
    route = request.scope.get("route")
    needed = required_role(request.method, str(getattr(route, "path", request.url.path)))
    if principal.role < needed:
        raise PgsieveError(
            f"this needs the '{needed.name}' role; token '{principal.name}' has "
            f"'{principal.role.name}'",
            code=ErrorCode.FORBIDDEN, status=403, title="Forbidden",
            required_role=needed.name, role=principal.role.name,
        )
    return principal


require_token = authorize  # the name routers were wired with before roles existed


def may_see_rows(principal: Principal) -> bool:
    """Row data — sample rows, keys, PostgreSQL's messages about rows — is for operators
    and admins (what a viewer's answers leave out: :mod:`pgsieve.api.rowdata`)."""
    return principal.role >= Role.operator


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
SecretBoxDep = Annotated[SecretBox, Depends(get_secret_box)]
PrincipalDep = Annotated[Principal, Depends(current_principal)]
