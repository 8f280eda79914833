PY ?= python3
.PHONY: setup demo test test-slow lint

# "$(PY)": a Python whose path has spaces works too.
setup:
	@PYTHON="$(PY)" bash scripts/setup.sh

demo: setup
	"$(PY)" -m draftsmith demo

test: setup
	"$(PY)" -m pytest -q

test-slow: setup
	"$(PY)" -m pytest -q -m slow

lint:
	"$(PY)" -m ruff check src tests benchmarks
