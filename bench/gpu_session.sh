#!/usr/bin/env bash
# One lent GPU's checks and benchmarks in priority order, inside a time budget (a lent machine's
# start takes minutes of a 15-minute allowance): the CUDA tests (the compiled one too), the
# moe-7b-shaped step with the preset's activation checkpointing, compiled and eager (checkpointed
# MoE blocks under compile, traced whole since 2026-12-04), dense-1b's step under each
# checkpointing mode, then RL's rollout generation against transformers' in bf16 where time is
# left. Earlier sessions' stages (dense-1b compiled in bf16 and fp8, the moe-7b-shaped step without
# checkpointing, trimtab vs the plain loop, the profile) are in git history and BENCHMARKS.md.
# Run from the repository root on the GPU machine:
#
#     OUT=/some/dir bash bench/gpu_session.sh [budget_s]     # default 540
#
# Each stage runs under `timeout` with the lesser of its limit and what is left of the budget, its
# output in $OUT/<stage>.log; at most 8 files come back from a device call, and this writes 6:
# tests.log (the machine's GPU and torch first) moe.log moe.json recompute.log generate.log
# (tables printed in the logs: BENCHMARKS.md "RL rollout generation on CUDA", "Activation
# checkpointing ... on <GPU>").
# The tables are written to BENCHMARKS.md afterwards, where the repository is, from the saved
# repetitions, e.g. python bench/gpu.py --preset dense-1b --steps 6 --load $OUT/dense.json
# (a --load rewrites the section of its heading: load a partial file into a new section's flags).
#
# The machine's image has torch but not plotly (the run report), narwhals (plotly imports it) nor
# torchao (train.precision fp8): carry their wheels, with .whl/ git-ignored, and name .whl in the
# device call's carry list (torchao 0.17 is the one built against the image's torch 2.11):
#     pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl plotly==7.1.0 narwhals==2.29.0 torchao==0.17.0
set -u
BUDGET=${1:-540}
OUT=${OUT:-/tmp/trimtab-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRIMTAB_CACHE=/tmp/trimtab-cache
# Python packages the machine's image lacks, carried as wheels (.whl/, git-ignored): pure-Python
# wheels are zip files, unpacked as they are (no pip needed)
if compgen -G ".whl/*.whl" >/dev/null; then
    for wheel in .whl/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site; done &&
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

stage() { # stage NAME MAX_S COMMAND...: run it with the lesser of MAX_S and the budget left
    local name=$1 max=$2 left=$((BUDGET - SECONDS))
    shift 2
    if ((left < 30)); then
        echo "=== $name: skipped, ${left}s left" | tee -a "$OUT/$name.log"
        return
    fi
    ((max > left)) && max=$left
    echo "=== $name (at ${SECONDS}s, limit ${max}s): $*" | tee -a "$OUT/$name.log"
    local t0=$SECONDS
    timeout -k 10 "$max" "$@" >>"$OUT/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0))s" | tee -a "$OUT/$name.log"
    # timeout signals the stage's own process; a trainer child handles SIGTERM by finishing its
    # step, so end every process of the stage before the next one needs the GPU
    pkill -9 -f "bench/gpu.py|pytest -m gpu" || true
    tail -n 12 "$OUT/$name.log" | grep -v "^===" || true
}

GPU="python3 bench/gpu.py --steps 6 --warmup 3"
MOE="--preset moe-7b --set model.n_layers=2"
# Seen on an H200 (2026-12-04, 565 s budget): the CUDA tests 56 s, dense-1b's two compiled
# processes 200 s, the moe-7b-shaped compiled one ~100 s and its eager one cut at its last step by
# the stage's 160 s (run again alone: ~90 s). A session's start and transfers took ~3 minutes.
# The GPU, torch and the imports go to tests.log too: one file fewer to bring back.

stage tests 30 bash -c 'nvidia-smi; python3 -c "
import torch, torch.nn.functional as F
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
print(\"F.grouped_mm:\", hasattr(F, \"grouped_mm\"), \"torch._grouped_mm:\", hasattr(torch, \"_grouped_mm\"))
import trimtab, plotly.graph_objects; print(\"trimtab and plotly import\")
import torchao.float8; print(\"torchao\", __import__(\"torchao\").__version__)"'
# the compiled test too: train.compile compiles each block on its own (distributed/wrapping.py)
stage tests 100 python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rA
# MoE (issue 35's >= 40% MFU goal) as the preset trains it, with activation checkpointing: compiled
# (its blocks broke the graph at the checkpoint before 2026-12-04), then eager
stage moe 200 env TORCH_LOGS=recompiles,graph_breaks $GPU $MOE --variants trimtab-compile,trimtab --reps 1 \
    --save "$OUT/moe.json"
# Activation checkpointing off / selective / full on dense-1b's step: selective's cost on a GPU
# (the planner assumes 1.05x off's compute) and each mode's memory against plan/memory.py
stage recompute 90 python3 bench/recompute.py --device cuda --presets dense-1b --reps 1 --steps 4
# RL rollouts on the GPU (issue 35): trimtab's batched generation against transformers' on
# dense-1b's shape in bf16, 64 prompts x 128 tokens (bench/generate.py; its CPU section apart)
stage generate 150 python3 bench/generate.py --device cuda --dtype bf16 --preset dense-1b --batch 64 --new 128 \
    --reps 3 --work /tmp/trimtab-generate
echo "=== done at ${SECONDS}s"
