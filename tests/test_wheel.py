"""The built wheel works without a checkout (issue 59, item 5): installed into a fresh
virtualenv, ``pgsieve db upgrade`` migrates a store and ``pgsieve api`` serves the API
and the dashboard — the migrations and ``frontend/`` travel inside the wheel
(``pgsieve/_assets/``, put there by ``setup.py``'s build hook).

The wheel is built from a copy of this tree (a build writes ``build/`` and
``*.egg-info`` where it runs) and installed with ``--no-deps``; its dependencies come
from this checkout's environment through a path file, which adds their directory but not
its own path files — so the editable ``pgsieve`` of the checkout is not importable there,
and every ``pgsieve`` module the commands run is the wheel's (asserted). Installing the
dependencies afresh would copy ~900 MB (pyspark) for nothing this test checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from pgsieve.platform.pgcluster import free_port

ROOT = Path(__file__).resolve().parents[1]
UV = Path(sys.executable).parent / "uv"
NOT_BUILT = ("build", "dist", ".git", ".venv", ".pgsieve", "test-artifacts", "*.egg-info",
             "__pycache__", "*.so", "*.c", ".mypy_cache", ".ruff_cache", ".pytest_cache")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the built wheel installed; its directory."""
    work = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, work / "tree", ignore=shutil.ignore_patterns(*NOT_BUILT))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(work / "dist"),
                    str(work / "tree")], check=True, cwd=work)
    (wheel,) = (work / "dist").glob("pgsieve-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([str(UV), "pip", "install", "--quiet", "--no-deps", "--python",
                    str(venv / "bin" / "python"), str(wheel)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "zz_checkout_dependencies.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PGSIEVE_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PGSIEVE_HOME=str(tmp_path / "home"),
               PGSIEVE_DATABASE_URL=f"sqlite:///{tmp_path / 'meta.db'}",
               PGSIEVE_API_TOKEN="wheel-test-token-" + "x" * 24,
               PGSIEVE_SECRET_KEY="wheel-test-secret-" + "y" * 24)
    return env


def test_the_wheel_migrates_a_store_and_serves_the_api_and_dashboard(installed, tmp_path):
    env = _env(tmp_path)
    python, pgsieve = installed / "bin" / "python", installed / "bin" / "pgsieve"
    where = subprocess.run(
        [str(python), "-c", "import pgsieve, pgsieve.platform.assets as a; "
         "print(pgsieve.__file__); print(a.asset_dir('frontend')); "
         "print(a.asset_dir('migrations'))"],
        cwd=tmp_path, env=env, check=True, capture_output=True, text=True).stdout.split()
    assert all(path.startswith(str(installed)) for path in where), where

    done = subprocess.run([str(pgsieve), "db", "upgrade"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "meta.db").stat().st_size > 0

    port = free_port()
    api = subprocess.Popen([str(pgsieve), "api", "--host", "127.0.0.1", "--port", str(port)],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/healthz", timeout=5) as r:  # noqa: S310
                    if r.status == 200:
                        break
            except OSError:
                assert api.poll() is None, api.stdout.read() if api.stdout else ""
                assert time.monotonic() < deadline, "the API did not come up"
                time.sleep(0.2)
        with urllib.request.urlopen(f"{base}/", timeout=10) as r:  # noqa: S310
            page = r.read().decode()
        assert "<html" in page.lower() and "app.js" in page
        with urllib.request.urlopen(f"{base}/static/app.js", timeout=10) as r:  # noqa: S310
            assert r.status == 200 and len(r.read()) > 1000
        token = env["PGSIEVE_API_TOKEN"]
        request = urllib.request.Request(  # noqa: S310
            f"{base}/api/v1/sources", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as r:  # noqa: S310
            assert r.status == 200 and r.read() == b"[]"
    finally:
        api.terminate()
        api.wait(timeout=30)
