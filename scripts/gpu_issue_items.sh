#!/usr/bin/env bash
# The open issues' GPU items, for a lent GPU machine, after scripts/gpu_check.sh has built the
# package there (same session, same tree): one command each, sized to fit the lease.
#   - issue 41 item 5: the default entry points (the DeepSpeed block with only "enabled",
#     dcr.compile) against FSDP2 + per-block compile and DeepSpeed at a training shape, with and
#     without HF checkpointing: collective calls per step, step time, and (the op tables) where
#     the host and the device spend it, to tell whether the step is host-bound;
#   - issue 42: the takeover with each offload (optimizer, parameters, both) against stock
#     DeepSpeed with the same offload: step time and accelerator peak.
# Issue 43 item 5's GPU cells (cut-quality, peak-plan) are in gpu_check.sh itself.
# Logs and tables go to $OUT when set (the device tool), else to bench_out/.
# DCR_ITEMS_DEVICE, DCR_ITEMS_WORLD, DCR_ITEMS_SHAPE and DCR_ITEMS_STEPS override the device
# (cuda), the local ranks (1: the lent machine has one GPU), the model and the timed steps; a
# CPU dry run of the commands: DCR_ITEMS_DEVICE=cpu DCR_ITEMS_WORLD=2 DCR_ITEMS_SHAPE="--model
# llama --layers 2 --hidden 64 --heads 4 --seq 64" DCR_ITEMS_STEPS=1 bash scripts/gpu_issue_items.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
device="${DCR_ITEMS_DEVICE:-cuda}"; world="${DCR_ITEMS_WORLD:-1}"
default_shape="--model llama --layers 8 --hidden 1024 --heads 16 --seq 1024"
read -r -a shape <<<"${DCR_ITEMS_SHAPE:-$default_shape}"
steps="${DCR_ITEMS_STEPS:-10}"
status=0
step() { echo; echo "=== $*"; }
compare() {  # compare OUT_NAME ARGS...: one compare run (it prints its table)
  local name=$1 cache; shift
  cache="$(mktemp -d)"  # a fresh inductor cache: the first step compiles
  TORCHINDUCTOR_CACHE_DIR="$cache" deepcompile-remat compare "${shape[@]}" \
    --device "$device" --world "$world" --steps "$steps" --warmup 3 --no-plots --quiet \
    --out "$OUT/$name" "$@" 2>"$OUT/$name.err" || { status=1; tail -5 "$OUT/$name.err"; }
  rm -rf "$cache"
}

step "issue 41 item 5: the default entry points at a training shape"
compare defaults --precisions autocast bf16 --op-table \
  --peers ours-deepspeed ours-compile fsdp2-block-compiled deepspeed-lean
compare defaults-ckpt --checkpointing --precisions autocast --op-table \
  --peers ours-deepspeed ours-compile fsdp2-block-compiled deepspeed-lean

step "issue 42: each offload, the takeover against stock DeepSpeed"
compare offload --precisions bf16 \
  --peers ours-deepspeed-offload deepspeed-lean-offload ours-deepspeed-offload-params \
  deepspeed-lean-offload-params ours-deepspeed-offload-all deepspeed-lean-offload-all
exit $status
