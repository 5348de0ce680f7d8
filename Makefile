# jobtier: two commands do all the set-up on a fresh Debian machine.
#   make run    local Redis + Postgres (in .data/), then API, worker, scheduler, persister
#   make test   the whole test suite against real Redis and Postgres
#   make fuzz   the API fuzzer alone, thousands of cases (make test runs a bounded share)
#   make docs   the documentation site (mkdocs.yml, docs/) into site/, strictly: a broken link fails
# Both are idempotent: a second run reuses the virtualenv, packages and data that are there.
# The `jobtier` command is .venv/bin/jobtier: `. .venv/bin/activate` puts it on PATH (the
# banner of `make run` prints that line); nothing is written outside the clone.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test fuzz check lint types format bench bench-report docs setup system-deps run-deps clean

# ARGS: jobtier run's own options, e.g. make run ARGS="--api-port 8001 --data-dir /tmp/jt"
ARGS ?=
run: run-deps $(STAMP)
	$(BIN)/jobtier run $(ARGS)

test: setup
	$(BIN)/pytest -q

# schemathesis against the live API (tests/e2e/test_api_fuzz.py): FUZZ_EXAMPLES random cases
# per operation on top of the schema's examples and boundary values; a new seed every run,
# printed (`fuzz seed …`), and `make fuzz FUZZ_SEED=<seed>` replays that run's cases; no
# per-test timeout (a deep run takes minutes)
FUZZ_EXAMPLES ?= 200
FUZZ_SEED ?=
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_SEED=$(FUZZ_SEED) $(BIN)/pytest -q -rA --timeout 0 tests/e2e/test_api_fuzz.py

check: setup lint types docs test

lint: setup
	$(BIN)/ruff check src tests bench loadtest scripts
	$(BIN)/ruff format --check src tests bench loadtest scripts

types: setup
	$(BIN)/mypy src tests scripts/docs_hooks.py bench

format: setup
	$(BIN)/ruff format src tests bench loadtest scripts
	$(BIN)/ruff check --fix src tests bench loadtest scripts

bench: setup
	$(BIN)/python bench/throughput.py

# docs/benchmarks.md (and README's block between the bench-report markers) from the results
# files in bench/results; standard library only, so no set-up needed
bench-report:
	$(PYTHON) bench/report.py

# the site: pages from docs/, the HTTP API, CLI and Python reference pages generated from the
# code (scripts/docs_hooks.py, mkdocstrings); --strict: a broken link, anchor or page fails
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

setup: system-deps $(STAMP)

# redis-server (with redis-cli) from Debian when missing; Postgres binaries likewise.
system-deps:
	@scripts/system-deps.sh

# what `make run` needs of them: the Redis and Postgres servers only
run-deps:
	@scripts/system-deps.sh --run

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

clean:
	rm -rf .data .pytest_cache .mypy_cache .ruff_cache site
