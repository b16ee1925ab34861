#!/usr/bin/env bash
# One lent GPU's checks and benchmarks in priority order, inside a time budget (a lent machine's
# start takes minutes of a 15-minute allowance): the CUDA tests, the moe-7b-shaped step with and
# without activation checkpointing, eager and compiled, dense-1b compiled in bf16 and in fp8, then
# a profile of the moe-7b-shaped step. Earlier sessions' stages (dense-1b and moe-7b-shaped trimtab
# vs the plain loop) are in git history and BENCHMARKS.md. Run from the repository root on the GPU
# machine:
#
#     OUT=/some/dir bash bench/gpu_session.sh [budget_s]     # default 540
#
# Each stage runs under `timeout` with the lesser of its limit and what is left of the budget, its
# output in $OUT/<stage>.log; at most 8 files come back from a device call, and this writes 8:
# tests.log (the machine's GPU and torch first) moe.log moe_ckpt.json moe.json dense.log
# dense.json profile.txt profile.json (the profile stage logs to moe.log).
# The tables are written to BENCHMARKS.md afterwards, where the repository is, from the saved
# repetitions, e.g. python bench/gpu.py --preset dense-1b --steps 6 --load $OUT/dense.json
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
NOCKPT="--set train.activation_checkpointing=false"
# Seen on an H100 and an H200 (2026-11-25/26): the CUDA tests ~60 s (the compile test 38 of them,
# left out here); a dense-1b process ~75 s eager (its end-of-run checkpoint of 1.1B parameters and
# their AdamW state included), ~130 s compiled; a moe-7b-shaped process ~50 s. So ~10 + 60 + 150
# + 260 + 60 = 540 s; each stage saves after each variant, so a cut keeps what finished.
# The GPU, torch and the imports go to tests.log too: one file fewer to bring back.

stage tests 30 bash -c 'nvidia-smi; python3 -c "
import torch, torch.nn.functional as F
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
print(\"F.grouped_mm:\", hasattr(F, \"grouped_mm\"), \"torch._grouped_mm:\", hasattr(torch, \"_grouped_mm\"))
import trimtab, plotly.graph_objects; print(\"trimtab and plotly import\")
import torchao.float8; print(\"torchao\", __import__(\"torchao\").__version__)"'
stage tests 100 python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rA -k "not compiled"
# MoE (issue 35's >= 40% MFU goal): the preset as it is (activation checkpointing on), then
# without checkpointing (2 layers fit without it), eager and compiled (grouped experts traced whole)
stage moe 60 $GPU $MOE --variants trimtab --reps 1 --save "$OUT/moe_ckpt.json"
stage moe 130 $GPU $MOE $NOCKPT --variants trimtab,trimtab-compile --reps 1 --save "$OUT/moe.json"
# FP8 (goal >= 1.3x bf16 tokens/s on dense-1b): both compiled, as float8's scaling fuses there
stage dense 280 $GPU --preset dense-1b --variants trimtab-compile,trimtab-fp8-compile --reps 1 --save "$OUT/dense.json"
# trimtab's 3 steps after the warm-up under torch.profiler: profile.txt (the table), profile.json
stage moe 80 python3 bench/gpu.py --steps 3 --warmup 3 $MOE $NOCKPT --profile "$OUT/profile.txt"
echo "=== done at ${SECONDS}s"
