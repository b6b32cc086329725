# solrl: `make demo` runs the tiny-digits Sol-RL campaign, `make test` lint, the docs build and the tests.
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

.PHONY: demo test lint docs docs-serve screenshots gpu-kit install clean

# pip byte-compiles the environment (about 25 s): keep it. Where PYTHONDONTWRITEBYTECODE is set (this project's
# machines set it) nothing a process imports is ever cached, and without pip's .pyc files every process compiles
# torch again (a fresh clone's `make test` took 1666 s with `pip install --no-compile`).
$(BIN)/.installed: pyproject.toml constraints/cpu.txt constraints/test.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_CONSTRAINTS) -c constraints/test.txt -e '.[test]'
	touch $@

# Transformer Engine's Python sources, unpacked beside the venv and never installed (with TE's meta package installed,
# diffusers and peft try to import it and fail without CUDA): tests/test_hardware.py builds solrl's recipes with TE's
# own recipe module and checks solrl's TE calls against its source, at solrl's floor (2.9.0), the version
# `make gpu-kit` packs for a GPU (2.16.1, the first with NVFP4's row-scaled activations), and the newest release when
# this list was last extended (2.20.2). About 1 MiB each.
TE_SOURCE_VERSIONS := 2.9.0 2.16.1 2.20.2
TE_SOURCES := $(foreach v,$(TE_SOURCE_VERSIONS),$(VENV)/te-source/$(v)/transformer_engine)
$(VENV)/te-source/%/transformer_engine: | $(BIN)/.installed
	$(BIN)/python -m pip download --quiet --no-deps transformer-engine==$* -d $(VENV)/te-source
	$(BIN)/python -m zipfile -e $(VENV)/te-source/transformer_engine-$*-py3-none-any.whl $(VENV)/te-source/$*

install: $(BIN)/.installed $(TE_SOURCES)

demo: $(BIN)/.installed
	$(BIN)/solrl run tiny-digits

# Formatting and lint are the machine's job (ruff, configured in pyproject.toml); `make test` runs them first.
lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# The documentation site (docs/, mkdocs.yml) into site/. --strict: a broken link or anchor, a page missing from the
# navigation or a docstring mkdocstrings cannot read fails the build. The generated pages (config and CLI
# reference, one page per model family) are written by docs/gen_pages.py at build time. The two variables silence
# MkDocs' and Material's banners about their successors (printed on every build).
docs: install
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: install
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# The site's screenshots (docs/images/screenshots/): a real tiny-digits campaign on a Prefect server and MLflow's
# UI, photographed in headless Chromium (Debian's chromium package). Minutes, not part of `make test`.
screenshots: install
	$(BIN)/python docs/screenshots.py --out docs/images/screenshots

# The wheels a GPU machine without a network needs for bench/gpu_session.sh, into .whl/ (docs/development/benchmarks.md).
gpu-kit: $(BIN)/.installed
	PYTHON=$(BIN)/python bench/gpu_kit.sh

# Two pytest-xdist workers, one test file each at a time (module fixtures stay shared), one thread each
# (tests/conftest.py): most of the suite waits on subprocesses and servers, so two workers halve its time on two cores.
# --no-loadscope-reorder: the files in collection order, the longest first (tests/conftest.py's HEAVIEST_FIRST).
test: lint docs
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) runs site .cache/docs
