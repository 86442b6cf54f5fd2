# The two set-up commands: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-test
PYTEST_ARGS ?=
DEMO_ARGS ?=
ARCH     ?= $(shell dpkg --print-architecture 2>/dev/null || echo amd64)
DEB_MODE ?= offline
# the full model-zoo matrix's exports (bench/bench_model_zoo_full.py): torch only ever in a
# venv of its own, and only for them
TORCH_VENV ?= build/torchvenv
ZOO_FULL := build/zoo-full/fixtures.json
TORCH_PINS := torch==2.14.1 torchvision==0.29.1 onnx==1.23.2 onnxscript==0.7.2 scikit-learn==1.9.1

.PHONY: demo test test-pg test-arm lint bench zoo-fixtures soak deb clean help

help:
	@echo "make demo   - create .venv, install, run a coordinator + 4 agents for 3 rounds (see demo-out/)"
	@echo "make test   - create .venv if needed, install with test extras, run ruff, the import layers and pytest (random order; TEST_SEED=N repeats one)"
	@echo "make test-pg - the coordinator's tests with the registry on a throw-away PostgreSQL (apt-get install postgresql)"
	@echo "make bench  - run bench/ and rewrite BENCHMARKS.md (makes the zoo fixtures first)"
	@echo "make zoo-fixtures - torchvision's CNNs at real width, both exporters, into build/zoo-full (torch in build/torchvenv: never a project dependency)"
	@echo "make soak   - a fleet for 1,000 rounds (real mosquitto, 4 agents): growth per round -> BENCHMARKS.md"
	@echo "make deb    - build dist/edge-agent_<ver>_<arch>.deb (ARCH=arm64, DEB_MODE=thin)"
	@echo "make test-arm - (root) the .debs installed and run on emulated Raspberry Pi OS arm64 + armhf (qemu-user)"

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "edge-agent needs Python 3.11 (MXNet 1.9.1 needs numpy<1.24)"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip setuptools wheel

# Reinstall when the project metadata or the native kernel sources change.
# The distribution was called edge-agent before it became mxedge-agent: a venv made then
# still holds it, and removing it later would delete the shared console scripts.
$(STAMP): $(BIN)/python pyproject.toml $(wildcard setup.py) $(wildcard kernels/*.c kernels/*.h kernels/*.json)
	$(BIN)/pip uninstall --quiet --yes edge-agent 2>/dev/null || true
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m edge_agent.demo $(DEMO_ARGS)

# The suite runs in random order (pytest-random-order): modules shuffled, and the tests
# inside each module, so a test that leans on what ran before it fails somewhere. Each run
# draws a seed, printed before pytest starts and in its header ("--random-order-seed=N");
# `make test TEST_SEED=N` repeats that order exactly.
TEST_SEED ?=
RANDOM_ORDER = -p random_order --random-order-bucket=module --random-order-seed=$$seed
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	@seed="$(TEST_SEED)"; [ -n "$$seed" ] || seed=$$(od -An -N3 -tu4 /dev/urandom | tr -d ' '); \
	echo "test order: random, seed $$seed (make test TEST_SEED=$$seed repeats this order)"; \
	echo "$(BIN)/python -m pytest $(RANDOM_ORDER) $(PYTEST_ARGS)"; \
	$(BIN)/python -m pytest $(RANDOM_ORDER) $(PYTEST_ARGS)

# The coordinator's tests again with the registry on PostgreSQL: one throw-away cluster per
# run (tests/pg_cluster.py: Debian's postgresql package, a free loopback port; as root the
# server runs as nobody), a fresh database per test (pytest --pg, tests/conftest.py); the
# integration tests' serve processes inherit $EDGE_COORDINATOR_DB (test_fleet_load's harness
# too: it reads the registry through Registry, whichever the engine).
PG_TESTS ?= tests/unit/test_coordinator_*.py tests/unit/test_registry_pg.py tests/unit/test_retention.py tests/unit/test_async_rounds.py \
	tests/unit/test_approval.py tests/unit/test_cli_exit_codes.py tests/unit/test_plateau.py \
	tests/unit/test_dashboard_views.py tests/unit/test_update_defaults.py tests/unit/test_requantize.py \
	tests/unit/test_server_opt.py tests/unit/test_workers_pg.py \
	tests/unit/test_shared_rounds_pg.py tests/integration/test_pg_workers.py \
	tests/integration/test_fleet_round.py tests/integration/test_fleet_restart.py tests/integration/test_fleet_cli.py \
	tests/integration/test_fleet_agents.py tests/integration/test_fleet_security.py tests/integration/test_device_limits.py \
	tests/integration/test_retention_broker.py tests/integration/test_update_metadata.py tests/integration/test_dashboard.py \
	tests/integration/test_agent_models.py tests/integration/test_transport_upload.py tests/integration/test_transport_models.py \
	tests/integration/test_fleet_load.py tests/integration/test_fleet_engine_choices.py
test-pg: $(STAMP)
	$(BIN)/python -m pytest --pg $(PG_TESTS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/ruff format --check . || true

bench: $(STAMP) $(ZOO_FULL)
	$(BIN)/python -m bench.run

# The full model-zoo matrix's exports, remade when their generator changes (~15 min).
zoo-fixtures: $(ZOO_FULL)
$(ZOO_FULL): tests/fixtures/models/make_torch_fixtures.py
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install --quiet $(TORCH_PINS)
	rm -rf build/zoo-full
	$(TORCH_VENV)/bin/python tests/fixtures/models/make_torch_fixtures.py --full build/zoo-full

# Long: hours on a quiet machine (bench/soak.py). SOAK_ROUNDS=300 for a shorter one.
SOAK_ROUNDS ?= 1000
soak: $(STAMP)
	EDGE_SOAK_ROUNDS=$(SOAK_ROUNDS) $(BIN)/python -m bench.run --only bench_soak

# Root only: debootstrap a Bookworm root per architecture (cached in build/arm/), install
# the .deb there under qemu-user and run probe, kernels and finetune in each, then one fleet
# of both (tests/arm/emulated_pi.py). The roots are prepared side by side; ARM_ARGS=--serial
# prepares one after the other.
ARM_ARCHES ?= arm64,armhf
ARM_ARGS ?=
test-arm: $(STAMP)
	$(BIN)/python tests/arm/emulated_pi.py --arch $(ARM_ARCHES) $(ARM_ARGS)

# offline (release): every pinned wheel ships in the package; thin (CI): only ours.
deb: $(STAMP)
	$(BIN)/python packaging/build-deb --arch $(ARCH) --mode $(DEB_MODE) --out dist --lint

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
