# Two commands on a fresh machine: `make train` and `make test`. Each creates .venv and installs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test test-all clean gpu-check gpu-wheels

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,gpu-aot]'
	touch $(STAMP)

# The default tiny Llama on the Python standard library sources, CPU, end to end. JAX_PLATFORMS
# pins the CPU: the gpu-aot extra's CUDA plugin would otherwise look for a GPU and complain.
train: $(STAMP)
	rm -rf runs/debug
	JAX_PLATFORMS=cpu $(BIN)/meshtron train --config=debug --workdir=runs/debug

# The fast default suite on 8 fake CPU devices (slow cases: `make test-all`), in 3 worker
# processes on 2 cores: each test file runs whole in one worker (module fixtures are shared);
# the third fills the time others wait on subprocesses (clean clone at a9ba7ed: 20m12s with 3,
# about 22 min with 2).
TEST_WORKERS ?= 3
# Under the trainer's malloc settings (trainer/process/host_memory.py), like `meshtron` runs.
test: $(STAMP)
	$(BIN)/python -m trainer.process.host_memory $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

test-all: $(STAMP)
	$(BIN)/python -m trainer.process.host_memory $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m ''

clean:
	rm -rf $(VENV) runs .jax_cache .pytest_cache *.egg-info

# Regenerates benchmarks/results/ (about 1.5 h on 2 cores; the MaxText comparison installs MaxText
# in its own venv under ~/.cache/meshtron-peers on first use): the measured peak; tokens/s and MFU
# of the tiny and 100M models on 1 device, fsdp=8 and fsdp=4 x tensor=2 (runs alternate,
# BENCH_ROUNDS times); the tiny model's bf16 step against its float32 step; compile time of 2 vs
# 32 layers; the layout sweep and its plots; meshtron vs MaxText; MoE vs dense; the overlap facts
# of the 8.86B programs; the planner's time (70B on 512 GPUs, --compile_top=16); context
# parallelism's four programs; the estimate against the 8.86B H100 programs; page faults under
# glibc's malloc and the trainer's; then the results section of docs/results.md.
BENCH_ROUNDS ?= 2
RESULTS := benchmarks/results
.PHONY: bench
bench: $(STAMP)
	mkdir -p $(RESULTS)
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.peak > $(RESULTS)/peak.jsonl
	rm -f $(RESULTS)/train_step.jsonl $(RESULTS)/compile_scaling.jsonl $(RESULTS)/compare.jsonl
	for round in $$(seq $(BENCH_ROUNDS)); do for model in tiny 100m; do \
	  for layout in "" fsdp=8 fsdp=4,tensor=2; do \
	    $(BIN)/python -m benchmarks.train_step --model=$$model --layout=$$layout --remat=none \
	      --steps=8 --warmup=3 --peak_file=$(RESULTS)/peak.jsonl --label=round$$round \
	      >> $(RESULTS)/train_step.jsonl || exit 1; \
	done; done; done
	rm -f $(RESULTS)/bf16_vs_float32.jsonl
	for round in $$(seq $(BENCH_ROUNDS)); do for dtype in bfloat16 float32; do \
	  $(BIN)/python -m benchmarks.train_step --model=tiny --remat=none --dtype=$$dtype --steps=8 \
	    --warmup=3 --peak_file=$(RESULTS)/peak.jsonl --label=round$$round \
	    >> $(RESULTS)/bf16_vs_float32.jsonl || exit 1; \
	done; done
	for round in $$(seq $(BENCH_ROUNDS)); do for layers in 2 32; do \
	  $(BIN)/python -m benchmarks.train_step --model=100m --layers=$$layers --steps=0 \
	    --peak_file=$(RESULTS)/peak.jsonl \
	    --label=round$$round >> $(RESULTS)/compile_scaling.jsonl || exit 1; \
	done; done
	$(BIN)/python -m benchmarks.sweep --out $(RESULTS)/sweep.csv --pairs 1:none,4:full
	$(BIN)/python -m benchmarks.plot_sweep --csv $(RESULTS)/sweep.csv --out_dir $(RESULTS)
	$(BIN)/python -m benchmarks.compare --rounds $(BENCH_ROUNDS) --dtype bfloat16,float32 \
	  --out $(RESULTS)/compare.jsonl
	$(BIN)/python -m benchmarks.compare --summarize $(RESULTS)/compare.jsonl \
	  > $(RESULTS)/compare_summary.jsonl
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.moe_vs_dense --steps=300 \
	  --variants=dense,dropless,dropping > $(RESULTS)/moe_vs_dense.jsonl
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.overlap > $(RESULTS)/overlap.jsonl
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.planner_speed > $(RESULTS)/planner_speed.jsonl
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.context_parallel > $(RESULTS)/context_parallel.jsonl
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.compile_vs_estimate \
	  > $(RESULTS)/compile_vs_estimate.jsonl
	MESHTRON_DEFAULT_MALLOC=1 $(BIN)/python -m benchmarks.train_step --model=100m --steps=3 \
	  --warmup=1 --peak_file=$(RESULTS)/peak.jsonl --label=default_malloc > $(RESULTS)/host_memory.jsonl
	$(BIN)/python -m benchmarks.train_step --model=100m --steps=3 --warmup=1 \
	  --peak_file=$(RESULTS)/peak.jsonl --label=trainer_malloc >> $(RESULTS)/host_memory.jsonl
	$(BIN)/python -m benchmarks.report --results $(RESULTS) --doc docs/results.md

# Issue [26]'s anchors table: published recipes compiled deviceless for their own clusters
# (benchmarks/anchor_recipes.py), then its section of docs/planning.md; about 30 minutes of
# compiles on 2 cores (the rows' compile_s; DeepSeek-V3's alone 16). The "before" rows are kept as committed. Not part of `make test`.
.PHONY: anchors
anchors: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.step_time_anchors --doc docs/planning.md

# Issue [26]'s top-3 check by compiling: `meshtron plan`'s first three layouts for each anchor,
# compiled for the anchor's cluster at its precision and set beside the anchor's own program
# (benchmarks/anchor_plan_compiled.py); about 15 minutes on 2 cores. Not part of `make test`.
.PHONY: anchor-plans
anchor-plans: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.anchor_plan_compiled
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.step_time_anchors --render_only --doc docs/planning.md

# On a machine with NVIDIA GPUs and JAX's CUDA plugin (nothing is installed over that jax): the
# `gpu` tests and the GPU benchmarks, one JSON line per result in $(GPU_OUT)/<phase>.jsonl
# (benchmarks/gpu_check.py). PHASE = smoke, tests, kernels, train, fp8, moe or all; each phase is one
# command of at most ~8 minutes on one H100. Without a GPU it fails with one line and changes
# nothing.
GPU_PYTHON ?= python3
PHASE ?= all
GPU_OUT ?= benchmarks/results/gpu
gpu-check:
	MESHTRON_COMMIT=$${MESHTRON_COMMIT:-$$(git rev-parse HEAD 2>/dev/null)} \
	  $(GPU_PYTHON) -m benchmarks.gpu_check --phase $(PHASE) --out_dir $(GPU_OUT) $(GPU_CHECK_ARGS)

# Wheels for Python 3.12 that the GPU machine lacks (it reaches no registry), into .whl/ for
# carrying there; the versions are pyproject.toml's pins (tests/test_gpu_check.py compares them).
GPU_WHEELS := grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 ml-collections==1.1.0 \
  tensorboardX==2.6.5 jax-triton==0.3.1 flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
