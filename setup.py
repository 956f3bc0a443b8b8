"""Build hook: the wheel carries the dashboard (``frontend/``) and the Alembic migrations
(``migrations/``) inside the package, as ``pgsieve/_assets/``.

The checkout keeps them at the top level, where the folder tree shows them as parts of
the product; ``pgsieve.platform.assets`` finds them in either place. Everything else is in
``pyproject.toml``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
ASSETS = ("frontend", "migrations")


class BuildPyWithAssets(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's own folders
            return
        into = Path(self.build_lib) / "pgsieve" / "_assets"
        for name in ASSETS:
            shutil.copytree(ROOT / name, into / name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithAssets})
