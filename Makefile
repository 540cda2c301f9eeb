# The two commands of the README: `make demo` (the main job) and `make test`.
# Each creates and fills .venv when it is missing or out of date with setup.py (with the extra
# "cluster": Ray, which the tests of beamplugin-translate --ray need).
# Another corpus: make demo ARGS="--files corpus.de corpus.en" (or ARGS="--tsv pairs.tsv").
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench tables isa-check

$(BIN)/.installed: setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev,cluster]'
	touch $@

demo: $(BIN)/.installed
	PATH=$(CURDIR)/$(BIN):$$PATH bash data/run_demo.sh $(ARGS)

# The server's page is tested in Debian's headless chromium through its driver (test_server.py).
/usr/bin/chromedriver:
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null

# Our kernels' NEON build is cross-compiled and run under qemu (tests/test_instruction_sets.py).
/usr/bin/aarch64-linux-gnu-gcc /usr/bin/qemu-aarch64:
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user >/dev/null

# The suite on the best kernels this CPU runs; then its bit-for-bit tests (marked exact) again on
# the AVX2 kernels and on torch's (docs/architecture.md, "Instruction sets").
test: $(BIN)/.installed /usr/bin/chromedriver /usr/bin/aarch64-linux-gnu-gcc /usr/bin/qemu-aarch64
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests
	BEAMPLUGIN_ISA=avx2 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m exact tests
	BEAMPLUGIN_ISA=off $(BIN)/python -m pytest -q -n 2 --dist loadfile -m exact tests

# Our kernels against torch's on each instruction set this CPU runs; speed against fairseq, the
# roofline (the decode against its matrix products alone) and the precision table (bf16 and
# int8: fp16 is emulated, so slow, on CPUs without it); the same ARGS go to those three (e.g.
# ARGS="--path CKPT --data DATA-BIN"); then the GPU's code path (the device engine) on the CPU
# beside the other engine: its host time a step, watched without a GPU. Each appends its records
# to RESULTS (under build/, ignored by git): the tables render only benchmarks/results/*.jsonl,
# into which chosen records are copied (docs/performance.md, "Results").
RESULTS ?= build/bench.jsonl
bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks.kernels --threads 1 --results $(RESULTS)
	$(BIN)/python -m benchmarks.bf16 --threads 1 --parts kernels --results $(RESULTS)
	$(BIN)/python -m benchmarks.generate --threads 2 --max-sentences 128 --repeats 3 \
		$(or $(ARGS),--random --batch-sizes 1 64) --results $(RESULTS)
	$(BIN)/python -m benchmarks.roofline $(or $(ARGS),--random --batch-sizes 1 64) \
		--results $(RESULTS)
	$(BIN)/python -m benchmarks.precision --precisions bf16 int8 $(or $(ARGS),--random \
		--batch-sizes 1 64 --max-sentences 64 --repeats 2) --results $(RESULTS)
	$(BIN)/python -m benchmarks.gpu_step --device cpu --models tiny --batch-sizes 1 64 \
		--sentences 128 --rounds 2 --precision float32 --systems ours device \
		--results $(RESULTS)

# The results tables of README.md and docs/ rewritten from benchmarks/results/*.jsonl, the one
# place figures are written (tests/test_results_tables.py fails while a table differs).
tables:
	$(PY) benchmarks/render_tables.py

# Our C kernels compiled for AVX2 and AVX-512, counting the fused multiply-adds on the stack:
# each is a spilled accumulator (docs/architecture.md, "add an instruction set").
isa-check:
	bash benchmarks/isa_check.sh .
