"""Where the product's non-Python parts are: the dashboard and the Alembic migrations.

A checkout (and its editable install) has them at the top of the tree (``frontend/``,
``migrations/``); a wheel carries them inside the package as ``pgsieve/_assets/`` (the
build hook in ``setup.py``), so ``pip install pgsieve-*.whl`` serves the dashboard and
runs ``pgsieve db upgrade`` with no checkout anywhere.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
CHECKOUT = PACKAGE.parent


def asset_dir(name: str) -> Path:
    """``frontend`` or ``migrations``: the wheel's copy when installed from one, else the
    checkout's."""
    bundled = PACKAGE / "_assets" / name
    return bundled if bundled.is_dir() else CHECKOUT / name
