# One command each; targets create .venv and install on demand.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench lint clean

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

bench: $(STAMP)
	$(PY) benchmarks/paper_eval.py --with-cpsat
	$(PY) benchmarks/planning_time.py
	$(PY) benchmarks/runtime_cpu.py --workload tiny-clip

lint: $(STAMP)
	$(VENV)/bin/ruff check megatron_spindle tools tests benchmarks pretrain_multitask.py

clean:
	rm -rf $(VENV) build *.egg-info demo_output
