# One command each; targets create .venv and install on demand.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench bench-snapshot lint clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (megatron-core 0.16.1 needs Python 3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned megatron-core would pull a multi-GB CUDA torch.
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
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

# The same runs, refreshing the committed snapshot in benchmarks/results/ (a deliberate step: review the diff).
bench-snapshot: $(STAMP)
	$(PY) benchmarks/paper_eval.py --with-cpsat --update-snapshot
	$(PY) benchmarks/planning_time.py --update-snapshot
	$(PY) benchmarks/runtime_cpu.py --workload tiny-clip --steps 8 --update-snapshot

lint: $(STAMP)
	$(VENV)/bin/ruff check megatron_spindle tools tests benchmarks pretrain_multitask.py

clean:
	rm -rf $(VENV) build *.egg-info demo_output
