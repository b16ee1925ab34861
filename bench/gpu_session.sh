#!/usr/bin/env bash
# One lent GPU's checks and benchmarks in priority order, inside a time budget (a device call
# runs at most 10 minutes): the CUDA tests, the fused loss by chunk size, moe-7b-shaped layers,
# dense-1b eager, then dense-1b compiled. Run from the repository root on the GPU machine:
#
#     OUT=/some/dir bash bench/gpu_session.sh [budget_s]     # default 540
#
# Each stage runs under `timeout` with what is left of the budget, its output in $OUT/<stage>.log
# (at most 8 files come back from a device call: the logs and gpu.py's --save files). The
# tables are written to BENCHMARKS.md afterwards, where the repository is, from the saved
# repetitions: python bench/gpu.py --load $OUT/dense.json $OUT/dense_compile.json ...
#
# The machine's image has torch but not plotly (the run report): carry its wheel, e.g.
#     pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl plotly==7.1.0
# with .whl/ git-ignored, and name .whl in the device call's carry list.
set -u
BUDGET=${1:-540}
OUT=${OUT:-/tmp/trimtab-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRIMTAB_CACHE=/tmp/trimtab-cache
# Python packages the machine's image lacks, carried as wheels (.whl/, git-ignored)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
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
# Seen on an H200 (2026-11-25): the tests take ~60 s (the compile test 38 of them); a dense-1b
# process ~75 s (its end-of-run checkpoint of 1.1B parameters and their AdamW state included),
# the compiled one ~130 s; a moe-7b-shaped process ~50 s, ~60 s with padded experts.

stage env 60 bash -c 'nvidia-smi; python3 -c "
import torch, torch.nn.functional as F
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
print(\"F.grouped_mm:\", hasattr(F, \"grouped_mm\"), \"torch._grouped_mm:\", hasattr(torch, \"_grouped_mm\"))
import trimtab, plotly; print(\"trimtab imports\")"'
stage tests 150 python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rA
stage loss 90 bash -c "python3 bench/loss.py --chunks 1024 4096 5120 8192 --reps 25 &&
    python3 bench/loss.py --vocab 32000 --chunks 1024 8192 --reps 25"
stage moe 150 $GPU $MOE --variants trimtab,plain --reps 1 --save "$OUT/moe.json"
stage dense 240 $GPU --preset dense-1b --variants trimtab,plain --reps 2 --save "$OUT/dense.json"
stage dense 160 $GPU --preset dense-1b --variants trimtab-compile --reps 1 --save "$OUT/dense_compile.json"
echo "=== done at ${SECONDS}s"
