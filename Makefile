# make install: .venv with torch (CPU pin first), fairseq-fixed and this project.
# make test:    the test suite.   make demo: the fp32/fp16/bf16 side-by-side run.
# make soak:    the long reliability run (2,000 fp16 updates with injected overflows) and the
#               resume matrix's cells that make test leaves out.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH_PIN := torch==2.13.0
FAIRSEQ_PIN := fairseq-fixed==0.12.3.1

.PHONY: install test soak demo clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	# The pin first: with no torch present, a bare "torch" requirement pulls a CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q numpy cython
	# fairseq-fixed compiles extensions against the installed torch: no build isolation.
	$(BIN)/python -c "import fairseq" 2>/dev/null || \
		$(BIN)/python -m pip install -q --no-build-isolation $(FAIRSEQ_PIN)
	$(BIN)/python -m pip install -q --no-build-isolation -e '.[fairseq,tools,test,plots]'
	touch $@

# Two workers (pytest-xdist), each test file whole in one of them: half the time on two cores.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

soak: install
	$(BIN)/python -m pytest -q -s -m soak tests

demo: install
	$(BIN)/python scripts/demo.py

clean:
	rm -rf $(VENV) build *.egg-info
