#!/usr/bin/env bash
# .venv-codegen: openapi-python-client, exactly as requirements-codegen.lock pins it (every
# file checked against its sha256), in a venv of its own: it pins typer below the version
# pgsieve's CLI uses. tests/api/test_generated_client.py runs it on /openapi.json.
# Idempotent: does nothing when the venv already has the locked generator.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-codegen
want=$(sed -nE 's/^openapi-python-client==([^ ]+).*/\1/p' requirements-codegen.lock)
if [ -x "$venv/bin/openapi-python-client" ] && \
   "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('openapi-python-client') != '$want')" 2>/dev/null; then
  exit 0
fi
.venv/bin/uv venv --quiet --python .venv/bin/python "$venv"
.venv/bin/uv pip install --quiet --python "$venv/bin/python" --require-hashes -r requirements-codegen.lock
