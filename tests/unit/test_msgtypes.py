"""pgoutput's type bytes have one home (:mod:`pgsieve.wire.msgtypes`); the compiled
modules read them from ``_msgtypes.pxd``, which must say the same."""

from __future__ import annotations

import re
from pathlib import Path

from pgsieve.wire import msgtypes

PXD = Path(msgtypes.__file__).with_name("_msgtypes.pxd")


def _python_bytes() -> dict[str, int]:
    return {name: value for name, value in vars(msgtypes).items()
            if name.isupper() and isinstance(value, int)}


def test_the_pxd_declares_every_byte_with_the_same_value():
    declared = {name: int(value, 16) for name, value in
                re.findall(r"^\s+([A-Z_]+) = (0x[0-9A-Fa-f]+)$", PXD.read_text(), re.M)}
    assert declared == _python_bytes()


def test_each_byte_is_its_letter():
    for name, value in _python_bytes().items():
        assert 0x41 <= value <= 0x7A, name
    assert chr(msgtypes.BEGIN) + chr(msgtypes.COMMIT) + chr(msgtypes.STREAM_COMMIT) == "BCc"
    assert {ord("I"), ord("U"), ord("D")} == msgtypes.ROW_CHANGES
