from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgsieve.wire.lsn import InvalidLsn, Lsn, format_lsn


def test_parse_and_format():
    lsn = Lsn.parse("16/B374D848")
    assert lsn.value == (0x16 << 32) | 0xB374D848
    assert str(lsn) == "16/B374D848"
    assert str(Lsn.parse("0/0")) == "0/0"
    assert str(Lsn.parse("0/1a")) == "0/1A"
    assert repr(lsn) == "Lsn('16/B374D848')"


@pytest.mark.parametrize("text", ["", "0", "0/", "/0", "1/2/3", "G/0", "123456789/0", "-1/0",
                                  "0x1/0", " / "])
def test_invalid(text):
    with pytest.raises(InvalidLsn):
        Lsn.parse(text)


def test_compare_subtract_add():
    a, b = Lsn.parse("0/100"), Lsn.parse("1/0")
    assert a < b and b > a and a != b and Lsn.parse("0/100") == a
    assert b - a == (1 << 32) - 0x100
    assert a - b == -((1 << 32) - 0x100)
    assert a + 0x10 == Lsn.parse("0/110")
    assert max([a, b]) is b
    assert not Lsn(0) and a


def test_range():
    with pytest.raises(InvalidLsn):
        Lsn(-1)
    with pytest.raises(InvalidLsn):
        Lsn(1 << 64)
    assert str(Lsn((1 << 64) - 1)) == "FFFFFFFF/FFFFFFFF"


def test_coerce_and_format():
    assert Lsn.coerce(None) is None
    assert Lsn.coerce(5) == Lsn(5)
    assert Lsn.coerce("0/5") == Lsn(5)
    assert format_lsn(None) is None
    assert format_lsn(0x1_0000_0005) == "1/5"


@given(st.integers(min_value=0, max_value=(1 << 64) - 1))
def test_round_trip(value):
    assert Lsn.parse(str(Lsn(value))).value == value
