# One command each; targets create .venv and install on demand.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Where pip gets torch. Empty (the default): pip's own index and configuration. Where that resolves torch to the
# CUDA build (PyPI's Linux x86_64 wheels pull several GB of CUDA libraries), choose the CPU build:
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
TORCH_PIP_ARGS := $(if $(strip $(TORCH_INDEX_URL)),--index-url $(strip $(TORCH_INDEX_URL)))

.PHONY: install demo test bench bench-snapshot lint clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (megatron-core 0.16.1 needs Python 3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned (and from TORCH_INDEX_URL when given): an unpinned megatron-core would pull a multi-GB CUDA torch.
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

# Prints the tables and writes them to benchmarks/out/ (not committed).
bench: $(STAMP)
	$(PY) benchmarks/paper_eval.py --with-cpsat
	$(PY) benchmarks/planning_time.py
	$(PY) benchmarks/runtime_cpu.py --workload tiny-clip
	$(PY) benchmarks/memory_options.py
	$(PY) benchmarks/cost_model_validation.py
	$(PY) benchmarks/host_floor.py
	$(PY) benchmarks/host_ops.py --workload tiny-clip --two-ranks
	$(PY) benchmarks/data_reads.py
	$(PY) benchmarks/frozen_modules.py

# The same runs, refreshing the committed snapshot in benchmarks/results/ (a deliberate step: review the diff).
bench-snapshot: $(STAMP)
	$(PY) benchmarks/paper_eval.py --with-cpsat --update-snapshot
	$(PY) benchmarks/planning_time.py --update-snapshot
	$(PY) benchmarks/runtime_cpu.py --workload tiny-clip --steps 8 --update-snapshot
	$(PY) benchmarks/memory_options.py --update-snapshot
	$(PY) benchmarks/cost_model_validation.py --update-snapshot
	$(PY) benchmarks/host_floor.py --update-snapshot
	$(PY) benchmarks/host_ops.py --workload tiny-clip --two-ranks --update-snapshot
	$(PY) benchmarks/data_reads.py --update-snapshot
	$(PY) benchmarks/frozen_modules.py --update-snapshot

lint: $(STAMP)
	$(VENV)/bin/ruff check megatron_spindle tools tests benchmarks pretrain_multitask.py

clean:
	rm -rf $(VENV) build *.egg-info demo_output
