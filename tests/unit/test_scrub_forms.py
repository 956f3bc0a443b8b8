"""Issue 54, hole 6: the log scrubber masks the password forms it used to miss — a
Python dict's repr, JSON, and the PGPASSWORD environment variable — and keeps masking
the ones it knew."""

from __future__ import annotations

import logging

import pytest

from pgsieve.platform.credentials import MASK, SecretsFilter, scrub_secrets

SECRET = "hunter2-Zq9"


@pytest.mark.parametrize("text", [
    f"connecting with {{'user': 'x', 'password': '{SECRET}', 'host': 'h'}}",
    f'{{"user": "x", "password": "{SECRET}"}}',
    f'{{"password":"{SECRET}","sslpassword":"{SECRET}"}}',
    f"{{'PASSWORD': '{SECRET}'}}",
    f"env PGPASSWORD={SECRET} psql -h db",
    f"PGPASSWORD='{SECRET} with spaces' pg_dump",
    f'{{"password": "a\\"b{SECRET}"}}',
    # the forms it knew
    f"host=h password={SECRET} user=u",
    f"postgresql://u:{SECRET}@h/d",
    f"postgresql://u@h/d?password={SECRET}&sslmode=require",
])
def test_every_form_is_masked(text: str) -> None:
    scrubbed = scrub_secrets(text)
    assert SECRET not in scrubbed and MASK in scrubbed, scrubbed


def test_log_records_are_masked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    logger = logging.getLogger("pgsieve.test.scrub")
    handler = logging.Handler()
    records: list[logging.LogRecord] = []
    handler.emit = records.append  # type: ignore[method-assign,assignment]
    handler.addFilter(SecretsFilter())
    logger.addHandler(handler)
    try:
        logger.info("options %s", {"password": SECRET, "user": "x"})
        logger.info("env: PGPASSWORD=%s", SECRET)
    finally:
        logger.removeHandler(handler)
    assert records and all(SECRET not in r.getMessage() for r in records)


def test_ordinary_text_is_left_alone() -> None:
    for text in ('{"user": "x", "passwords_rotated": 3}', "my_password=plain words",
                 "the password is set"):
        assert scrub_secrets(text) == text
