from __future__ import annotations

import logging

import pytest

from pgsieve.platform.credentials import (
    MASK,
    CredentialError,
    InvalidDsn,
    SecretBox,
    SecretsFilter,
    dsn_summary,
    mask_dsn,
    scrub_secrets,
)


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://app:pa55@db.example:5433/sales?sslmode=require",
         f"postgresql://app:{MASK}@db.example:5433/sales?sslmode=require"),
        ("postgres://app@db/sales", "postgres://app@db/sales"),
        ("postgresql://db/sales?user=app&password=pa55",
         f"postgresql://db/sales?user=app&password={MASK}"),
        ("host=db port=5432 dbname=sales user=app password=pa55",
         f"host=db port=5432 dbname=sales user=app password={MASK}"),
        ("host=db dbname=sales user=app password='p a s s'",
         f"host=db dbname=sales user=app password={MASK}"),
    ],
)
def test_mask(dsn, expected):
    assert mask_dsn(dsn) == expected
    assert "pa55" not in mask_dsn(dsn)


def test_summary():
    assert dsn_summary("postgresql://app:x@h:1/d") == {
        "host": "h", "port": "1", "dbname": "d", "user": "app"}


@pytest.mark.parametrize("dsn", ["", "   ", "a = = b", "postgresql://[bad"])
def test_invalid(dsn):
    with pytest.raises(InvalidDsn):
        mask_dsn(dsn)


def test_secret_box_round_trip_and_wrong_key():
    box = SecretBox("k1")
    token = box.encrypt("postgresql://u:secret@h/d")
    assert "secret" not in token
    assert box.decrypt(token) == "postgresql://u:secret@h/d"
    with pytest.raises(CredentialError):
        SecretBox("k2").decrypt(token)


def test_scrub_and_log_filter(caplog):
    text = "failed for postgresql://u:hunter2@h/d and host=h password=hunter2 x"
    assert "hunter2" not in scrub_secrets(text)
    logger = logging.getLogger("pgsieve.test.scrub")
    handler = logging.StreamHandler()
    handler.addFilter(SecretsFilter())
    record = logger.makeRecord("x", logging.INFO, __file__, 1, "dsn=%s", (text,), None)
    handler.filter(record)
    assert "hunter2" not in record.getMessage()


def test_log_filter_scrubs_tracebacks():
    """``log.exception`` prints the exception's text again in the traceback."""
    import io
    import sys

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(SecretsFilter())
    logger = logging.getLogger("pgsieve.test.scrub.traceback")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        raise RuntimeError("cannot connect to postgresql://u:hunter2@h/d")
    except RuntimeError:
        assert sys.exc_info()[0] is RuntimeError
        logger.exception("a batch failed")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "Traceback" in out and "RuntimeError" in out and "a batch failed" in out
    assert "hunter2" not in out
