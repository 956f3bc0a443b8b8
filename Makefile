# The two commands a newcomer needs: `make run` (the demo) and `make test` (everything).
.PHONY: run test test-slow check lint typecheck deps lock bench clean

VENV := .venv
BIN := $(VENV)/bin

deps:
	@scripts/bootstrap.sh

run: deps
	$(BIN)/pgsieve run

lint: deps
	$(BIN)/ruff check .
	$(BIN)/lint-imports

typecheck: deps
	$(BIN)/mypy

# The fast lane: lint, import contracts, types and the pure unit tests (no clusters,
# no Spark, no Redis) — under two minutes; `make test` runs everything.
check: deps
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/pytest tests/unit -q

# Three pytest-xdist workers on two cores, each with its own PostgreSQL clusters and Spark
# session (a quarter of the machine idled with two: tests wait on leases and polls); a
# file's tests stay on one worker (module fixtures, ordered scenarios). TEST_WORKERS=0
# runs them in this process.
TEST_WORKERS ?= 3

test: deps
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --durations=30

# The randomized fault-injection runs at full size (make test runs 6 chosen seeds of the
# pipeline's, 2 of the initial copy's kills; 6 tenants sharing a slot, not 20).
test-slow: deps
	PGSIEVE_TEST_CHAOS_RUNS=24 $(BIN)/pytest tests/integration/test_pipeline_faults.py
	PGSIEVE_TEST_CHAOS_RUNS=16 $(BIN)/pytest tests/integration/test_sync_takeover.py
	PGSIEVE_TEST_SHARED_TENANTS=20 $(BIN)/pytest tests/integration/test_shared_decoding.py

# Re-resolve the lock after changing pyproject.toml's pins (or scripts/uv.in's, or
# scripts/codegen.in's: the client generator's own venv, scripts/codegen-venv.sh).
# requirements-runtime.lock (no dev extra) is what the production image installs. Every
# lock carries the sha256 of each file it may install, and every install checks them
# (--require-hashes: scripts/bootstrap.sh, the Dockerfile).
lock:
	$(BIN)/uv pip compile pyproject.toml --extra dev --generate-hashes -o requirements.lock --python $(BIN)/python
	$(BIN)/uv pip compile pyproject.toml --generate-hashes -o requirements-runtime.lock --python $(BIN)/python
	$(BIN)/uv pip compile scripts/uv.in --generate-hashes -o requirements-uv.lock --python $(BIN)/python
	$(BIN)/uv pip compile scripts/codegen.in --generate-hashes -o requirements-codegen.lock --python $(BIN)/python

bench: deps
	$(BIN)/python -m bench

clean:
	rm -rf .pgsieve test-artifacts .pytest_cache .mypy_cache .ruff_cache
