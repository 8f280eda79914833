PY ?= python3
.PHONY: setup demo test test-slow lint

# "$(PY)": a Python whose path has spaces works too.
setup:
	@PYTHON="$(PY)" bash scripts/setup.sh

demo: setup
	"$(PY)" -m draftsmith demo

# pytest-xdist: TEST_WORKERS processes (2: both cores of the 2-core machines CI runs on), each
# test file whole on one of them (its module fixtures built once, its compiles cached once).
TEST_WORKERS ?= 2

test: setup
	"$(PY)" -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-slow: setup
	"$(PY)" -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile

lint:
	"$(PY)" -m ruff check src tests benchmarks
