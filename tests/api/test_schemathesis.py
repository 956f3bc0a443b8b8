"""Property-based requests from the OpenAPI schema (schemathesis) with each role and with
no token: no 5xx, and every 4xx is problem+json with a documented ``code``."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hsettings
from schemathesis.core.result import Ok

from pgsieve.api.app import create_app
from tests.api.conftest import TOKEN
from tests.api.security_helpers import make_tokens

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 10  # per operation and caller: ~45 operations x 4 callers x 10, ~20 s


def _documented_codes() -> set[str]:
    text = "\n".join((ROOT / p).read_text() for p in ("docs/api.md", "docs/security.md"))
    return set(re.findall(r"`([a-z][a-z0-9_]+)`", text))


def _fuzz(operation: Any, who: str, token: str | None, documented: set[str],
          failures: list[str]) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    calls = 0

    @given(case=operation.as_strategy())
    @hsettings(max_examples=EXAMPLES, deadline=None, database=None,
               phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        nonlocal calls
        response = case.call(headers=headers)
        calls += 1
        status = response.status_code
        where = f"{who} {case.method} {case.formatted_path} -> {status}"
        if status >= 500:
            failures.append(f"{where}: {response.text[:300]}")
        elif status >= 400:
            ctype = response.headers.get("content-type", "")
            ctype = ctype[0] if isinstance(ctype, list) else ctype
            if not ctype.startswith("application/problem+json"):
                failures.append(f"{where}: not problem+json ({ctype})")
                return
            code = response.json().get("code")
            if code not in documented:
                failures.append(f"{where}: undocumented code {code!r}")
            if token is None and status != 401 and "healthz" not in case.formatted_path:
                failures.append(f"{where}: anonymous but not 401")

    run()
    return calls


def test_schemathesis_with_each_role(settings, metadata_engine):
    app = create_app(settings)
    tokens = make_tokens(metadata_engine)
    callers: dict[str, str | None] = {"anonymous": None, "viewer": tokens["viewer"],
                                      "operator": tokens["operator"], "admin": TOKEN}
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    documented = _documented_codes()
    calls = 0
    failures: list[str] = []
    started = time.monotonic()
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # the schema must be valid
        operation = result.ok()
        for who, token in callers.items():
            calls += _fuzz(operation, who, token, documented, failures)
    elapsed = time.monotonic() - started
    print(f"schemathesis: {calls} requests in {elapsed:.1f} s")
    assert calls >= 4 * 40
    assert not failures, "\n".join(sorted(set(failures))[:40])
