# `make demo` and `make test` each create .venv on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-test
DEMO_STAMP := $(VENV)/.installed-demo
PYTEST_ARGS ?= -n 2

.PHONY: demo test docs fuzz bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	# DeepSpeed builds against the installed torch, so it cannot come from the extras
	$(PY) -m pip install -q setuptools wheel
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation deepspeed==0.19.8
	touch $(STAMP)

# the demo needs the package and CPU torch only (the frameworks are for the tests)
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[torch]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/forkpoint demo

# tests whose ranks wait on each other run alone, after the others (see the `ranks` marker)
test: $(STAMP)
	$(PY) -m pytest -q --durations=12 $(PYTEST_ARGS) -m "not ranks" tests
	$(PY) -m pytest -q --durations=8 -m ranks tests

# the documentation site (site/), as CI builds it
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# the decoders fuzzed with many more examples than `make test` runs (random each time)
fuzz: $(STAMP)
	FORKPOINT_FUZZ_EXAMPLES=$${FORKPOINT_FUZZ_EXAMPLES:-20000} $(PY) -m pytest -q tests/test_fuzz.py

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks save_load

clean:
	rm -rf $(VENV) demo-repo bench-out site
