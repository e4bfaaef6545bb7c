# Set-up and everyday commands. Everything runs in ./.venv, created on first use.
#
#   make demo    nsa-diag branch on the embedded default (tiny preset; CPU unless CUDA is present): four
#                cases (cmp, sel, win, all), each a worker process under the hang/slow watchdog, in seconds
#   make test    the test suite but the tests marked slow, and beside it the Triton kernels once more on
#                the CPU (TRITON_INTERPRET=1, niced); make test-slow runs the slow ones (CI runs both),
#                installing the hf extra (transformers) first
#   make lint    ruff check + ruff format --check
#   make bench   the backend benchmarks (benchmarks/backends.py)
#   make bench-hangs  the hang benchmark's CPU set (benchmarks/hangs/run.py; ~10 min; HANGS_ARGS='--only
#                poll-file lock-order', '--slow' for the long run); make test-slow runs it with --check
#   make wheel-check  build the wheel, install it into a fresh venv outside the repository (offline: the
#                venv reuses .venv's dependencies) and run nsa-diag branch, matrix --list, matrix cpu-smoke
#                and a replay.sh from other directories (scripts/wheel_check.sh, about 30 s)
#   make gpu-smoke  the gpu-smoke matrix + selftest (+ selftest --ddp with 2 GPUs) on this machine's GPUs, a
#                short table at the end; run folders under nsa-diag-runs/gpu-smoke-<time> (exit 2 without GPU)
#   make matrix-<name>  nsa-diag matrix <name>, a target per shipped matrix (src/nsa_diag/matrices/<name>.yaml,
#                `nsa-diag matrix --list`): matrix-cpu-smoke (tiny
#                CPU cases, about a minute), matrix-gpu-smoke, matrix-backward, matrix-scaling,
#                matrix-production; options through MATRIX_ARGS, e.g.
#                make matrix-backward MATRIX_ARGS='--jobs 4 --junit backward.xml'
#
# TORCH_SPEC is the torch requirement installed first into a venv that has no torch yet. The default
# `torch==2.13.0` resolves to the CPU wheel kept on this machine's disk, where a plain `torch` would
# download a multi-GB CUDA build. Any release in the supported range works, e.g.
#   make install TORCH_SPEC='torch>=2.11,<2.15'

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
LINT_PATHS ?= $(wildcard src tests benchmarks)
PYTEST_ARGS ?=
# pytest-xdist processes. Most tests wait on subprocesses (a worker importing torch, a watchdog's stall
# limit, torchrun), so 3 keep a 2-core machine busy; a file's tests run in one process (--dist loadfile),
# so a module or session fixture (the case workers, the report's run folders) is made once.
# PYTEST_JOBS=0 runs in one process.
PYTEST_JOBS ?= 3
MATRIX_ARGS ?=
# Byte-compiled sources before the tests: where PYTHONDONTWRITEBYTECODE is set (this project's machines),
# each of the hundreds of processes the tests start (nsa-diag, its workers, the watchdog's helpers, the
# planted models) would compile nsa_diag and nsa_core from source again, ~0.2 s of CPU each.
COMPILE := -m compileall -q -j 0 src tests
# The nsa-diag the matrix-<name> targets run. Where Python already has torch and the toolkit's
# dependencies (a GPU machine), NSA_DIAG='python3 -m nsa_diag' with PYTHONPATH=src runs them without a venv.
NSA_DIAG ?= $(VENV)/bin/nsa-diag
MATRICES := src/nsa_diag/matrices
MATRIX_TARGETS := $(patsubst $(MATRICES)/%.yaml,matrix-%,$(wildcard $(MATRICES)/*.yaml))

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The Hugging Face extra, for the slow tests only (transformers: half a minute of the install)
STAMP_HF := $(VENV)/.installed-hf

.PHONY: install demo test test-slow lint bench bench-hangs gpu-smoke wheel-check

install: $(STAMP)

# Re-runs only when pyproject.toml is newer than the stamp (or the venv is gone).
# One pip run (torch, when the venv has none, beside the project: one resolve), without byte-compiling:
# pip compiles file by file in one process, half of a fresh install's minute; compileall then compiles
# the venv's packages on every core. Files that are not Python 3 of this version (torch keeps a few
# for newer Pythons) fail there as they do under pip, which skips them too: its output is not shown.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@torch=; $(BIN)/python -c "import torch" 2>/dev/null || torch='$(TORCH_SPEC)'; \
		echo "$(BIN)/python -m pip install --no-compile $${torch:+'$$torch' }-e '.[dev]'"; \
		$(BIN)/python -m pip install --no-compile $${torch:+"$$torch"} -e '.[dev]'
	@$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import site; print(site.getsitepackages()[0])')" \
		>/dev/null 2>&1 || true
	@touch $@

$(STAMP_HF): $(STAMP)
	$(BIN)/python -m pip install -e '.[dev,hf]'
	@touch $@

demo: $(STAMP)
	$(BIN)/nsa-diag branch

# make test's Triton kernels under the interpreter are a pytest of their own (TRITON_INTERPRET=1 must be in
# the environment before a kernel module is imported), started beside the main run in INTERPRET_JOBS
# pytest-xdist processes (0: in its own process). It is CPU alone (~2.5 min of it), where the main run's
# processes spend much of their time waiting on subprocesses and stall limits: side by side they keep the
# two cores busy, one after the other they took a minute more. It runs niced: the main run's tests, whose
# watchdogs and stall limits measure time, get the CPU first, as when they ran alone; the interpreter takes
# what they leave. Its output follows the main run's; make test fails if either fails, and an interrupted
# make stops both.
INTERPRET_JOBS ?= 2
INTERPRET := TRITON_INTERPRET=1 nice -n 10 $(BIN)/python -m pytest -q -n $(INTERPRET_JOBS) -m "not slow" \
	tests/core/triton

test: $(STAMP)
	@$(BIN)/python $(COMPILE) >/dev/null
	@log=$$(mktemp); $(INTERPRET) $(PYTEST_ARGS) >"$$log" 2>&1 & interp=$$!; \
	trap 'kill $$interp 2>/dev/null; rm -f "$$log"' EXIT; trap 'exit 130' INT TERM; \
	echo "$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) --dist loadfile -m \"not slow\" ..."; \
	$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) --dist loadfile -m "not slow" $(PYTEST_ARGS); main=$$?; \
	wait $$interp; interpret=$$?; echo '$(INTERPRET) ... (beside it):'; cat "$$log"; \
	[ $$main = 0 ] && [ $$interpret = 0 ]

# The tests marked slow (long end-to-end runs: the cpu-smoke matrix, gc-bisect, minimize, a Hugging Face
# model, the installed wheel...). CI runs them after `make test`: every test runs in CI.
test-slow: $(STAMP_HF)
	@$(BIN)/python $(COMPILE) >/dev/null
	$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) --dist loadfile -m slow $(PYTEST_ARGS)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(PYTEST_JOBS) -m slow tests/core/triton $(PYTEST_ARGS)
	$(MAKE) --no-print-directory bench-hangs HANGS_ARGS='--check $(HANGS_ARGS)'

# The hang benchmark's CPU set (benchmarks/hangs/: users' jobs that hang or stay healthy, each under
# `nsa-diag watch` with its defaults, scored against its truth): a table, and JSON in the run folder.
# make test-slow runs it with --check (exit 1 when one of issue 48's bars is missed).
HANGS_JOBS ?= 3
HANGS_ARGS ?=
bench-hangs: $(STAMP)
	@out=nsa-diag-runs/hangs-$$(date +%Y%m%d-%H%M%S); \
		echo "$(BIN)/python benchmarks/hangs/run.py --jobs $(HANGS_JOBS) --out $$out --json $$out/hangs.json $(HANGS_ARGS)"; \
		$(BIN)/python benchmarks/hangs/run.py --jobs $(HANGS_JOBS) --out $$out --json $$out/hangs.json $(HANGS_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

bench: $(STAMP)
	$(BIN)/python benchmarks/backends.py

# nsa-diag as a pip user gets it: the wheel in a fresh venv outside the repository, run from elsewhere.
wheel-check: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/wheel_check.sh

# The gpu-smoke matrix and selftest (plus selftest --ddp with 2+ GPUs) on this machine's GPUs, a short
# table at the end (scripts/gpu_smoke.sh). Exit 2 on a machine without a GPU.
gpu-smoke: $(if $(filter $(VENV)/bin/nsa-diag,$(NSA_DIAG)),$(STAMP))
	NSA_DIAG='$(NSA_DIAG)' bash scripts/gpu_smoke.sh

# A static pattern rule: make applies no implicit (plain pattern) rule to a phony target.
.PHONY: $(MATRIX_TARGETS)
$(MATRIX_TARGETS): matrix-%: $(MATRICES)/%.yaml $(if $(filter $(VENV)/bin/nsa-diag,$(NSA_DIAG)),$(STAMP))
	$(NSA_DIAG) matrix $* $(MATRIX_ARGS)
