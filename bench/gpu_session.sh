#!/usr/bin/env bash
# Every GPU check in one command on a GPU machine, each step under its own time limit; tables under $OUT.
#
# Where that machine has no network (the project's borrowed test GPUs), prepare the wheels it lacks with
# `make gpu-kit` (bench/gpu_kit.sh) and run this from the repo root there, with .whl/ beside it
# (docs/development/benchmarks.md):
#
#   bash bench/gpu_session.sh          # about 5 minutes; its steps' limits add up to 480 s
#
# With Transformer Engine they add up to 720 s: a command's 600 s limit would cut the compiled step first.
#
# Steps: install the carried wheels into /tmp/site; Transformer Engine into /tmp/site-te where .te/ came along (the
# last of the calls .te/CALLS.md lists, after `TE=2.16.1 make gpu-kit`; bench/te_kit.py); versions and the GPU;
# bench/gpu_smoke.py (first contact of the Transformer Engine and torchao backends: its tables say why a check did
# not run); bench/gpu_explore.py at published sizes, eager (throughput, the copy's bytes built against the memory
# plan's count, peak memory) and compiled for bf16 against torchao_fp8; the memory plan of the same presets. A step
# that fails or runs out of time leaves the tables written so far and the next step runs. Pick other presets with
# GPU_PRESETS="sd35-medium flux1-dev".
# SMOKE=1 checks the script on a machine without a GPU (tests/test_hardware.py): a tiny twin, every step's table.
# PY is the Python (python3), WHEELS the wheels' folder (.whl), OUT the tables' (gpu-out).
set -uo pipefail
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR=/tmp/solrl-inductor
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
PRESETS=(${GPU_PRESETS:-sd35-medium sana-1600m})
SIZE=(--batch 8 --steps 3)
COMPILED=(--compile compiled --mode default)
STRETCH=1
if [ "${SMOKE:-0}" = 1 ]; then  # the same commands and flags on one tiny twin, the compiled step run eager; the
  PRESETS=(${GPU_PRESETS:-tiny-sd3})  # limits stretched for a busy CPU (imports dominate there)
  SIZE=(--smoke --steps 1)
  COMPILED=(--compile eager)
  STRETCH=5
fi

step() {
  local name=$1 limit=$(($2 * STRETCH)) start=$SECONDS rc
  shift 2
  echo "### $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  echo "### $name: exit $rc after $((SECONDS - start)) s$([ "$rc" = 124 ] && echo ', out of time')"
}

if [ -d "$WHEELS" ]; then
  step install 40 "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site
else
  echo "no $WHEELS/ here: using the packages already installed (make gpu-kit first where there is no network)"
fi
TE_KIT=${TE_KIT:-.te}
if [ -f "$TE_KIT/SHA256SUMS" ]; then  # Transformer Engine carried in parts by the calls before this one (te_kit.py)
  step "transformer engine" 240 "$PY" bench/te_kit.py install --source "$TE_KIT" --target /tmp/site-te --wait 210
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site-te
fi
step versions 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv; \
  $PY -P -c 'import sys, torch, torchao, diffusers, solrl; print(sys.version.split()[0], torch.__version__, \
  torch.version.cuda, \"torchao\", torchao.__version__, \"diffusers\", diffusers.__version__)'"
step smoke 120 "$PY" bench/gpu_smoke.py
step explore 120 "$PY" bench/gpu_explore.py --presets "${PRESETS[@]}" "${SIZE[@]}" --compile eager \
  --out "$OUT/gpu_explore.md"
step compiled 120 "$PY" bench/gpu_explore.py --presets "${PRESETS[0]}" "${SIZE[@]}" "${COMPILED[@]}" \
  --precisions bf16 torchao_fp8 fp8 --out "$OUT/gpu_explore_compiled.md"
for preset in "${PRESETS[@]}"; do
  step "plan $preset" 25 "$PY" -P -c "import sys; from solrl.cli import app; sys.argv[0] = 'solrl'; app()" plan "$preset"
done | tee "$OUT/plan.md"
ls -la "$OUT"
