"""Shared schema pieces."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints

Name = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=63,
                      pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$"),
]
Dsn = Annotated[str, StringConstraints(min_length=1, max_length=4096)]


class StrictModel(BaseModel):
    """Request bodies: unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid")
