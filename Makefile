# Two commands are the contract: `make demo` and `make test`, each on a fresh machine.
# GPU users pick their torch: `make test TORCH="torch==2.6.0 --index-url https://download.pytorch.org/whl/cu124"`
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-models test-integrations test-bench test-batch-stats test-adapters test-pipeline test-experts test-tp test-cp test-reshard test-launcher test-foreign test-elastic test-streams test-muon test-ray test-trainer test-simulation test-slurm lint typecheck unit layout bench gpu-check gpu-check-multi soak clean install docs

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch goes in first and is then pinned via constraints, so no later dependency
# can replace it with a newer multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q $(TORCH)
	$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The main job: a small GPT trained on Python's own source with FSDP in 2 processes (~1 min).
demo: $(STAMP)
	$(VENV)/bin/shardwise demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples tools
	$(VENV)/bin/ruff format --check src tests bench examples tools

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: lint typecheck
	$(VENV)/bin/pytest -q

# The inner loop: under a minute (includes the layout and public-API checks). Tests marked
# `heavy` (memory simulations, subprocesses: a second or more each) run in `make test`.
unit: $(STAMP)
	$(VENV)/bin/pytest -q -m "not heavy" tests/unit

# Import cycles, layers, host imports, file and class sizes (also run by the unit tier).
layout: $(STAMP)
	$(PY) -m tools.layout check

# 50 transformers architectures under full_shard (about 1 min); .ci/run runs it after `test`.
test-models: $(STAMP)
	$(VENV)/bin/pytest -q -m models tests/models tests/e2e/test_bench_smoke.py

# shardwise inside mmengine's Runner and Lightning's Trainer, against their own DDP.
test-integrations: $(STAMP)
	$(VENV)/bin/pytest -q -m integrations tests/integrations tests/docs/test_host_examples.py tests/e2e/test_bench_smoke.py

# Losses from statistics of the whole batch (a mixture of experts' load balancing, masked
# means) under every layout at world 4 (about 1 min); .ci/run runs it after `test`.
test-batch-stats: $(STAMP)
	$(VENV)/bin/pytest -q -m batch_stats tests/distributed/test_batch_statistics.py

# Adapter models (peft's LoRA) under every layout at worlds 2 and 4: parity, checkpoints and
# exports; .ci/run runs it after `test`.
test-adapters: $(STAMP)
	$(VENV)/bin/pytest -q -m adapters tests/distributed tests/e2e/test_bench_smoke.py

# Pipeline parallel (pp 2 x dp 2 at world 4) under 1F1B and GPipe against one process: seven
# model families through the Engine, the layout and a negative control; .ci/run runs it.
test-pipeline: $(STAMP)
	$(VENV)/bin/pytest -q -m pipeline tests/distributed/test_pipeline.py tests/e2e/test_bench_smoke.py

# Expert parallel (ep 2 at world 4, alone and beside tp 2) against one process: three
# mixtures of experts through the Engine, the layout, a negative control and a checkpoint
# loaded in one process; .ci/run runs it.
test-experts: $(STAMP)
	$(VENV)/bin/pytest -q -m experts tests/distributed/test_expert_parallel.py tests/e2e/test_bench_smoke.py

# The fast memory simulation against the full one, to the byte, on small models of every
# kind: dense under every strategy, Gemma 2, Qwen2-MoE, Mixtral, tp, ep, LoRA, pipeline
# stages (about 2 min); `make test` keeps one model under each path. .ci/run runs it.
test-simulation: $(STAMP)
	$(VENV)/bin/pytest -q -m simulation tests/unit/memory/test_fast_simulation.py

# Tensor parallel (dp 2 x tp 2 at world 4) against one process: ten transformers families
# with their own plans, sequence and loss parallel, checkpoints; .ci/run runs it.
test-tp: $(STAMP)
	$(VENV)/bin/pytest -q -m tensor_parallel tests/distributed/test_tensor_parallel.py tests/distributed/test_tp_gradient_check.py

# Context parallel (Ulysses; cp 2 x dp 2 and cp 4 at world 4) against one process: four
# transformers families with packed documents, every data-parallel strategy, the router
# loss, a model of your own, the layout and negative controls; .ci/run runs it.
test-cp: $(STAMP)
	$(VENV)/bin/pytest -q -m context_parallel tests/distributed/test_context_parallel.py tests/e2e/test_bench_smoke.py

# Checkpoints resharded between every pair of layouts, and the check shown to fail; .ci/run
# runs it.
test-reshard: $(STAMP)
	$(VENV)/bin/pytest -q -m reshard tests/distributed/test_checkpoint.py

# `shardwise run`'s report when ranks fail, stall or die (processes started as a user
# starts them); .ci/run runs it.
test-launcher: $(STAMP)
	$(VENV)/bin/pytest -q -m "launcher and not slow" tests/e2e/test_launch_robust.py

# A plain script driven by a DeepSpeed JSON and an Accelerate YAML, and examples/port's causal LM
# under a DeepSpeed, Accelerate and torchtitan file, through `shardwise run
# --nproc 2`, against one process; .ci/run runs it.
test-foreign: $(STAMP)
	$(VENV)/bin/pytest -q -m foreign tests/e2e/test_foreign_configs.py tests/e2e/test_port.py

# Nodes lost and gained: two launchers under --nnodes 1:2 on one host form world 4, one is
# killed and another joins, and the run equals an uninterrupted one (about 4 minutes);
# .ci/run runs it.
test-elastic: $(STAMP)
	$(VENV)/bin/pytest -q -s -m elastic tests/e2e/test_elastic.py

# A real SLURM on this host (installed with apt-get when missing; root): srun, salloc and
# sbatch launches equal to one process, the documented CPU job, and a job preempted with
# SIGUSR1, requeued and resumed exactly (about 5 minutes); .ci/run runs it.
# A streamed corpus (a datasets stream, packed, 2 DataLoader workers) stopped and resumed at
# worlds 1, 2 and 4 and at other worker counts, through `shardwise run` (about 2 min).
test-streams: $(STAMP)
	$(VENV)/bin/pytest -q -m streams tests/e2e/test_streams.py

# shardwise.Muon at world 4 (ddp, full_shard, shard_grad_op, hybrid 2x2, dp 2 x tp 2,
# pp 2 x dp 2, ep 2; an MLP, a tiny llama, the llama with LoRA, a tiny mixtral, a tiny
# qwen2) against one process, its negative control, Newton–Schulz counted once per matrix
# in the job, and a checkpoint saved at world 4 loaded at world 2 and in one process
# (about 50 s; 75 s on a loaded 2-core host); and test_muon_fused.py: split_fused under
# full_shard and dp 2 x tp 2 against one process, and Muon's planned step memory against a
# real step (another group of 4, about 25 s).
test-muon: $(STAMP)
	$(VENV)/bin/pytest -q -m muon tests/distributed/test_muon.py tests/distributed/test_muon_fused.py

# shardwise's Runner inside Ray Train's TorchTrainer on a local Ray cluster (2 CPUs): 2
# workers equal to one, a worker killed mid-run resumed from the reported checkpoint, and a
# restart at another number of workers (about 3 minutes); .ci/run runs it.
test-ray: $(STAMP)
	$(VENV)/bin/pytest -q -m ray tests/integrations/test_ray.py

# transformers.Trainer and TRL's SFTTrainer on shardwise (ShardwiseTrainer) against the
# Trainer's own DDP: three launches, at worlds 2, 1 (a resume) and 4; .ci/run runs it.
test-trainer: $(STAMP)
	$(VENV)/bin/pytest -q -m trainer tests/integrations/test_transformers_trainer.py

test-slurm: $(STAMP)
	$(VENV)/bin/pytest -q -s -m slurm tests/e2e/test_slurm.py

# The benchmark scripts still run (tiny sizes; figures not checked); .ci/run runs it.
test-bench: $(STAMP)
	$(VENV)/bin/pytest -q -m "bench and not models and not integrations and not adapters and not pipeline and not experts and not context_parallel" tests/e2e/test_bench_smoke.py

bench: $(STAMP)
	$(PY) bench/overhead.py

# The documentation site (MkDocs, Material theme, API pages from the docstrings) into site/;
# --strict: any warning (a broken link, a docstring mkdocstrings cannot read) fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Everything one GPU can check, in under ten minutes; on a machine without one it says so.
gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

# What two or more GPUs can check that one cannot (pp, ep, tp, hybrid_shard, Fabric with
# devices=[1, 0], NCCL point-to-point and all-to-all, an elastic restart), each against one
# process; on a machine with fewer it says "needs ≥ 2 GPUs".
gpu-check-multi: $(STAMP)
	$(PY) bench/gpu_check_multi.py

# Launcher robustness: N trials per kind (a rank SIGKILLed at a random step under
# --max-restarts 2 must resume and end bitwise equal to an uninterrupted run). Prints "K of N".
N ?= 20
KINDS ?= restart
soak: $(STAMP)
	$(PY) bench/soak.py --trials $(N) $(foreach k,$(KINDS),--kind $(k))

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
