# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv and install the project with its pinned dependencies first
# (a no-op when already done).

PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.toy-installed

.PHONY: demo test test-fast lint bench smollm2 smollm2-dirs clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(VPY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	bash scripts/demo.sh

# Two workers of one torch thread each (tests/conftest.py): on 2 cores the suite takes
# about 11 minutes instead of 22 (a Zen 4 held to AVX2 code paths, inductor's cache and
# precompiled headers cold; each compiled generation step is a cold build of 6-8 s there,
# so tests build few; ~12 minutes on the Zen 4 itself, whose AVX-512 builds are slower),
# every test as it is. --dist loadscope: a module's tests
# run on one worker, so its module-scoped fixtures (a real model's LoRA run, a transformers
# load) are made once, not once a worker as under the default --dist load;
# --no-loadscope-reorder keeps the collection order (tests/conftest.py puts the longest
# tests first) where xdist would sort modules by their number of tests and start the
# one-test walks last.
# transformers' loads of the real GGUFs (the references SmolLM2's and Gemma-3's checks compare
# against) are kept in ~/.cache/toy/test-references, keyed by the file's sha256 and the
# library versions (tests/helpers/gguf_fixtures.py): a first run on a machine pays them once.
XDIST   := -n 2 --dist loadscope --no-loadscope-reorder
test: $(STAMP)
	$(VPY) -m pytest $(XDIST)

test-fast: $(STAMP)
	$(VPY) -m pytest $(XDIST) -m "not slow"

smollm2: $(STAMP)
	PYTHON=$(VPY) bash scripts/get-smollm2.sh .

smollm2-dirs: $(STAMP)
	PYTHON=$(VPY) bash scripts/get-smollm2-dirs.sh --q-group-size 32

clean:
	rm -rf $(VENV) build

bench: $(STAMP)
	$(VPY) bench/run.py

# One formatter and one linter, both ruff (pyproject.toml: line length 100); CI runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check src tests bench scripts
	$(VENV)/bin/ruff check src tests bench scripts
