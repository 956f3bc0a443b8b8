#!/usr/bin/env bash
# Creates .venv and installs exactly what requirements.lock pins (plus pgsieve itself),
# every file checked against the lock's sha256 (--require-hashes; uv itself too, from
# requirements-uv.lock). pgsieve is installed from this checkout without build isolation,
# so its build backend is the locked setuptools, not one fetched unchecked.
# Checks the two things pip cannot install: Java 17+ (Spark) and PostgreSQL >= 15 server
# binaries (local clusters for the demo and the tests).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "pgsieve setup: $*" >&2; exit 1; }

command -v python3 >/dev/null || fail "python3 (3.11+) is required"
python3 - <<'PY' || fail "Python 3.11 or newer is required"
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if ! command -v java >/dev/null; then
  fail "Java 17 or newer is required for Spark (Debian: apt-get install openjdk-17-jre-headless)"
fi
java_major=$(java -version 2>&1 | sed -nE 's/.*version "([0-9]+).*/\1/p' | head -n1)
[ -n "$java_major" ] && [ "$java_major" -ge 17 ] || \
  fail "Java 17 or newer is required for Spark; found: $(java -version 2>&1 | head -n1)"

bindir="${PGSIEVE_PG_BINDIR:-}"
if [ -z "$bindir" ]; then
  if command -v pg_config >/dev/null; then bindir=$(pg_config --bindir); fi
  if [ -z "$bindir" ] || [ ! -x "$bindir/initdb" ]; then
    bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1 || true)
  fi
fi
[ -n "$bindir" ] && [ -x "$bindir/initdb" ] && [ -x "$bindir/postgres" ] || \
  fail "PostgreSQL 15+ server binaries (initdb, postgres) not found (Debian: apt-get install postgresql-15), or set PGSIEVE_PG_BINDIR"
pg_major=$("$bindir/postgres" --version | sed -nE 's/.* ([0-9]+)(\.[0-9]+)?.*/\1/p')
[ "${pg_major:-0}" -ge 15 ] || fail "PostgreSQL 15+ server binaries are required; found $pg_major in $bindir"

# The dashboard's browser tests drive Debian's chromium through Playwright (never
# `playwright install`, which downloads its own browsers).
if ! command -v chromium >/dev/null && [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "pgsieve setup: installing chromium (browser tests)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null \
      || fail "could not install chromium with apt-get"
  else
    echo "pgsieve setup: chromium not found; the browser tests need it (Debian: sudo apt-get install chromium)" >&2
  fi
fi

# The deployment test validates docker-compose.yml with Compose itself (`config`; no
# daemon needed): Docker's `compose` plugin where present, else Debian's docker-compose.
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "pgsieve setup: installing docker-compose (the compose file's validation)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null \
      || fail "could not install docker-compose with apt-get"
  else
    echo "pgsieve setup: docker compose not found; the deployment test needs it (Debian: sudo apt-get install docker-compose)" >&2
  fi
fi

stamp=.venv/.pgsieve-installed
if ! { [ -f "$stamp" ] && [ "$stamp" -nt requirements.lock ] && [ "$stamp" -nt pyproject.toml ] \
       && [ "$stamp" -nt requirements-uv.lock ]; }; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --require-hashes \
    --no-deps --only-binary=:all: -r requirements-uv.lock
  # Bytecode compiled once here: with PYTHONDONTWRITEBYTECODE set (as on CI machines)
  # every worker and test process would otherwise compile each import from source.
  .venv/bin/uv pip sync --quiet --require-hashes --compile-bytecode \
    --python .venv/bin/python requirements.lock
  .venv/bin/uv pip install --quiet --python .venv/bin/python --no-deps \
    --no-build-isolation -e .
  touch "$stamp"
fi
# The compiled hot path (Cython + gcc; a no-op when up to date). Not fatal: without it
# pgsieve runs the pure-Python reference, slower, and says so in its log and /healthz.
.venv/bin/python scripts/build_compiled.py || true
# pgsieve's own bytecode too (stale files are recompiled in memory, never trusted).
.venv/bin/python -m compileall -q pgsieve >/dev/null || true
# The client generator of the generated-client test, in a venv of its own (a no-op when
# up to date; see the script).
scripts/codegen-venv.sh
