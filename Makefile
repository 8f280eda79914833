PY ?= python3
.PHONY: setup demo test test-all lint

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m draftsmith demo

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m "slow or not slow"

lint:
	$(PY) -m ruff check src tests
