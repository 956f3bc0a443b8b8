"""Builds pgsieve's compiled hot path in place (``make deps`` runs this).

``pgsieve/apply/_hotpath.pyx``, ``pgsieve/wire/_splitpath.pyx``,
``pgsieve/streaming/_pushpoll.pyx`` (the push thread's wait) and
``pgsieve/streaming/_copydrain.pyx`` (a turn's read of its replication session) →
``*.so`` beside them,
with Cython and the
system's C compiler (gcc and the Python headers; nothing is downloaded). Does nothing when
the module is newer than its source. A failed build is not fatal: pgsieve then runs its
pure-Python reference of the same code, slower, and says so (see
:mod:`pgsieve.apply.hotpath`). Exit status: 0 built or up to date, 1 failed.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"pgsieve.apply._hotpath": ROOT / "pgsieve" / "apply" / "_hotpath.pyx",
           "pgsieve.wire._splitpath": ROOT / "pgsieve" / "wire" / "_splitpath.pyx",
           "pgsieve.streaming._pushpoll": ROOT / "pgsieve" / "streaming" / "_pushpoll.pyx",
           "pgsieve.streaming._copydrain": ROOT / "pgsieve" / "streaming" / "_copydrain.pyx"}


def built_path(name: str) -> Path:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return ROOT.joinpath(*name.split(".")).with_suffix("").parent / (
        name.rsplit(".", 1)[1] + suffix)


SHARED = [ROOT / "pgsieve" / "wire" / "_bigendian.pxd", ROOT / "pgsieve" / "wire" / "_msgtypes.pxd"]
"""Declarations every module cimports: a change rebuilds them all."""


def stale() -> dict[str, Path]:
    shared = max(path.stat().st_mtime for path in SHARED)
    return {name: src for name, src in SOURCES.items()
            if not built_path(name).exists()
            or built_path(name).stat().st_mtime < max(src.stat().st_mtime, shared)}


def build(names: dict[str, Path]) -> None:
    from Cython.Build import cythonize  # build-time only
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    extensions = cythonize(
        [Extension(name, [str(src.relative_to(ROOT))], extra_compile_args=["-O2"])
         for name, src in names.items()],
        quiet=True, compiler_directives={"language_level": 3})
    dist = Distribution({"name": "pgsieve-compiled", "ext_modules": extensions})
    cmd = build_ext(dist)
    cmd.inplace = True
    cmd.build_temp = str(ROOT / "build" / "compiled")
    cmd.ensure_finalized()
    cmd.run()


def main() -> int:
    todo = stale()
    if not todo:
        return 0
    print(f"pgsieve setup: compiling the hot path ({', '.join(todo)})", file=sys.stderr)
    try:
        import os
        os.chdir(ROOT)
        build(todo)
    except Exception as exc:  # any failure: the pure-Python reference runs instead
        print(f"pgsieve setup: the compiled hot path could not be built ({exc}); pgsieve "
              "will run its pure-Python reference (slower)", file=sys.stderr)
        return 1
    missing = [name for name in todo if not built_path(name).exists()]
    if missing:
        print(f"pgsieve setup: the build left no module for {', '.join(missing)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
