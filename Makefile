# The two commands a newcomer needs: `make run` (the demo) and `make test` (everything).
.PHONY: run test lint typecheck deps lock bench clean

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

test: deps
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/pytest

# Re-resolve the lock after changing pyproject.toml's pins.
# requirements-runtime.lock (no dev extra) is what the production image installs.
lock:
	$(BIN)/uv pip compile pyproject.toml --extra dev -o requirements.lock --python $(BIN)/python
	$(BIN)/uv pip compile pyproject.toml -o requirements-runtime.lock --python $(BIN)/python

bench: deps
	$(BIN)/python -m bench

clean:
	rm -rf .pgsieve test-artifacts .pytest_cache .mypy_cache .ruff_cache
