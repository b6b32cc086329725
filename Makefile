# solrl: `make demo` runs the tiny-digits Sol-RL campaign, `make test` lint and the tests.
# Both create .venv if missing and install from this repo's own files.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines pin torch/torchvision (see constraints/cpu.txt). GPU users: install
# their CUDA torch into .venv first and run `make TORCH_CONSTRAINTS= demo`.
TORCH_CONSTRAINTS ?= -c constraints/cpu.txt
export HF_HUB_OFFLINE ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1

.PHONY: demo test lint install clean

$(BIN)/.installed: pyproject.toml constraints/cpu.txt constraints/test.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_CONSTRAINTS) -c constraints/test.txt -e '.[test]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/solrl run tiny-digits

# Formatting and lint are the machine's job (ruff, configured in pyproject.toml); `make test` runs them first.
lint: $(BIN)/.installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# Two pytest-xdist workers, one test file each at a time (module fixtures stay shared), one thread each
# (tests/conftest.py): most of the suite waits on subprocesses and servers, so two workers halve its time on two cores.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) runs
