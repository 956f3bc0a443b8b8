"""The code zip shipped with Spark jobs (issue 59, item 6), and the executors' check.

The zip must hold the package's Python sources and nothing else (a compiled module
cannot be imported from a zip, bytecode is the builder's Python's), be the same bytes
for the same sources — its name carries their hash, so a changed checkout ships a new
zip and an unchanged one is never rebuilt — and never be seen half-written. The task
wrapper must travel without pgsieve, so an executor without it says so by name. The
cluster itself is tests/integration/test_spark_shipping.py.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import threading
import types
import zipfile
from pathlib import Path

import pytest

from pgsieve.spark import shipping
from pgsieve.spark.shipping import (
    CODE_DIR,
    checked,
    code_zip,
    content_digest,
    driver_versions,
    should_ship,
    source_files,
    write_zip,
)


def _tree(root: Path) -> Path:
    """A package tree with everything the zip must leave out beside its sources."""
    pkg = root / "pgsieve"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "_assets" / "migrations").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("VALUE = 1\n")
    (pkg / "sub" / "_fast.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (pkg / "sub" / "_fast.pyx").write_text("# cython\n")
    (pkg / "sub" / "_fast.c").write_text("/* c */\n")
    (pkg / "sub" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"pyc")
    (pkg / "_assets" / "migrations" / "env.py").write_text("# not a task's\n")
    return pkg


def test_the_zip_holds_the_python_sources_only(tmp_path):
    pkg = _tree(tmp_path)
    shipped = code_zip(tmp_path / "home", root=pkg)
    with zipfile.ZipFile(shipped.path) as zf:
        names = zf.namelist()
    assert names == ["pgsieve/__init__.py", "pgsieve/sub/__init__.py", "pgsieve/sub/mod.py"]


def test_the_real_package_zips_without_compiled_modules_and_imports_from_the_zip(tmp_path):
    """The package as it is (the checkout's compiled .so beside its sources) — and a
    Python that cannot import pgsieve otherwise (-S: no site-packages, so no editable
    install) imports it from the zip, the hot path falling back to its reference."""
    shipped = code_zip(tmp_path)
    with zipfile.ZipFile(shipped.path) as zf:
        names = zf.namelist()
    assert "pgsieve/spark/shipping.py" in names and "pgsieve/sync/copypipe.py" in names
    assert all(n.endswith(".py") for n in names), [n for n in names if not n.endswith(".py")]
    assert not any("__pycache__" in n or "/_assets/" in n for n in names)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "import pgsieve.wire.hotpath as h, pgsieve; "
            "print(pgsieve.__file__); print(h.compiled is None)")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(shipped.path)],
                         capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    where, reference = out.split()
    assert where.startswith(str(shipped.path)) and reference == "True"


def test_same_sources_same_bytes_and_name_a_change_a_new_name(tmp_path):
    pkg = _tree(tmp_path / "a")
    first = code_zip(tmp_path / "h1", root=pkg)
    second = code_zip(tmp_path / "h2", root=pkg)
    assert first.path.name == second.path.name
    assert first.path.read_bytes() == second.path.read_bytes()
    assert first.path.name == (f"pgsieve-{shipping.pgsieve_version()}-"
                               f"{content_digest(source_files(pkg))}.zip")
    (pkg / "sub" / "mod.py").write_text("VALUE = 2\n")
    changed = code_zip(tmp_path / "h1", root=pkg)
    assert changed.built and changed.path != first.path and changed.digest != first.digest


def test_an_existing_zip_is_reused_not_rebuilt(tmp_path):
    pkg = _tree(tmp_path)
    built = code_zip(tmp_path / "home", root=pkg)
    stat = built.path.stat()
    again = code_zip(tmp_path / "home", root=pkg)
    assert built.built and not again.built and again.path == built.path
    assert again.path.stat().st_mtime_ns == stat.st_mtime_ns
    assert again.path.stat().st_ino == stat.st_ino
    assert built.path.parent == tmp_path / "home" / CODE_DIR


def test_a_failed_write_leaves_neither_the_zip_nor_a_temporary_file(tmp_path):
    pkg = _tree(tmp_path)
    files = [*source_files(pkg), ("pgsieve/gone.py", tmp_path / "no-such-file.py")]
    dest = tmp_path / "out" / "pgsieve-x.zip"
    with pytest.raises(FileNotFoundError):
        write_zip(files, dest)
    assert list(dest.parent.iterdir()) == []


def test_workers_building_at_once_each_see_a_whole_zip(tmp_path):
    """Two worker processes starting beside each other build the same zip: each writes
    a temporary file and renames it, so whichever rename lands, the zip is whole."""
    pkg = _tree(tmp_path)
    results: list[shipping.ShippedCode] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(code_zip(tmp_path / "home", root=pkg))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({r.path for r in results}) == 1
    with zipfile.ZipFile(results[0].path) as zf:
        assert zf.testzip() is None and len(zf.namelist()) == 3
    assert [p.name for p in results[0].path.parent.iterdir()] == [results[0].path.name]


@pytest.mark.parametrize(("master", "mode", "ships"), [
    ("local[*]", "auto", False), ("local[2]", "always", True), ("local", "auto", False),
    ("spark://m:7077", "auto", True), ("k8s://https://k:443", "auto", True),
    ("yarn", "auto", True), ("sc://c:15002", "auto", True),
    ("spark://m:7077", "never", False),
])
def test_when_the_code_ships(master, mode, ships):
    assert should_ship(master, mode) is ships


def test_nothing_is_built_or_shipped_where_it_should_not_be(tmp_path):
    """A local master (or ``never``) ships nothing and writes nothing: ``ship_code``
    does not even look at the session."""
    assert shipping.ship_code(object(), "local[2]", "auto", tmp_path) is None
    assert shipping.ship_code(object(), "spark://m:7077", "never", tmp_path) is None
    assert not (tmp_path / CODE_DIR).exists()


def _double(x: int) -> int:
    return 2 * x


def test_a_checked_task_runs_where_the_versions_match():
    assert checked(_double)(21) == 42


def test_another_pyspark_on_the_executor_is_named_with_the_drivers():
    python, pyspark_version = driver_versions()
    task = checked(_double, expected=(python, "3.9.9"))
    with pytest.raises(RuntimeError) as info:
        task(1)
    message = str(info.value)
    assert "pyspark 3.9.9" in message and f"pyspark {pyspark_version}" in message
    assert f"Python {python}" in message and sys.executable in message


def test_a_missing_module_is_named(monkeypatch):
    """A task whose module the executor cannot import: a third-party one is named as
    missing; pgsieve itself gets the shipping advice."""
    for name, expect in (("pgsieve_gone_pkg", "lacks 'pgsieve_gone_pkg'"),
                         ("pgsieve._gone_module", "pgsieve is not importable")):
        module = types.ModuleType(name)
        exec("def task(x):\n    return x\n", module.__dict__)  # noqa: S102 - a test module
        monkeypatch.setitem(sys.modules, name, module)
        task = checked(module.task)
        monkeypatch.delitem(sys.modules, name)
        with pytest.raises(RuntimeError, match=expect):
            task(1)


def test_the_wrapper_travels_to_a_python_without_pgsieve(tmp_path):
    """Unpickled where pgsieve cannot be imported (-S, only the dependencies' directory
    on the path), the wrapper itself loads — it refers to nothing of pgsieve — and its
    task, a pgsieve function, fails with the wrapper's own message."""
    from pyspark import cloudpickle

    from pgsieve.sync.copypipe import _ready

    data = tmp_path / "task.pickle"
    data.write_bytes(cloudpickle.dumps(checked(_ready)))  # type: ignore[no-untyped-call]
    code = ("import pickle, sys; sys.path.append(sys.argv[2]); "
            "task = pickle.loads(open(sys.argv[1], 'rb').read())\n"
            "try:\n    task(0)\nexcept RuntimeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(data),
                          sysconfig.get_paths()["purelib"]],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "pgsieve is not importable" in out.stdout
    assert "PGSIEVE_SPARK_SHIP_CODE" in out.stdout


EXECUTOR_PACKAGES = {
    "copy and diff tasks": (["pgsieve.sync.copypipe", "pgsieve.sync.reconcile.keyranges"],
                            {"psycopg", "psycopg_binary", "typing_extensions",
                             "cryptography", "_cffi_backend", "_openssl"}),
}
"""What docs/operations.md promises a copy's and a diff's tasks import on an executor
(third-party, top level; a compiled module's Cython runtime aside)."""


@pytest.mark.parametrize("what", sorted(EXECUTOR_PACKAGES))
def test_the_executor_side_imports_stay_what_the_docs_say(what):
    """The executors' contract lists the packages the tasks import: a new import in the
    modules a task runs (or in what they import) must show up here first — pydantic,
    SQLAlchemy and the settings are kept off this path on purpose."""
    modules, allowed = EXECUTOR_PACKAGES[what]
    code = ("import sys; before = set(sys.modules)\n"
            + "".join(f"import {m}\n" for m in modules)
            + "new = {n.split('.')[0] for n in set(sys.modules) - before}\n"
            "print(' '.join(sorted(new - set(sys.stdlib_module_names))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    imported = {m for m in out if m != "pgsieve" and not m.startswith(("_cython", "cython",
                                                                       "_sysconfigdata"))}
    assert imported <= allowed, f"{what} now import {sorted(imported - allowed)}"
