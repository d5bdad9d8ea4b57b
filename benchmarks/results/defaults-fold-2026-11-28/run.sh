# The default entry points against FSDP2 + per-block compile and DeepSpeed at the autocast cells
# of defaults-avx512-2026-11-28 (where a bf16 gradient reaches an fp32 reduce-scatter), after
# fold_reduce_casts: one round, each cell on a fresh inductor cache.
# Usage: bash run.sh [OUT] (default: results land beside this script)
mkdir -p "${1:-$(dirname "$0")}" && cd "${1:-$(dirname "$0")}"
P="ours-deepspeed ours-compile fsdp2-block-compiled deepspeed-lean"
for cell in "llama autocast 1024" "llama autocast 1024 --checkpointing" "qwen2 autocast 1024" "qwen2 autocast 1024 --checkpointing" "llama autocast 2048 --checkpointing"; do
  set -- $cell
  name=r1-$1-$2-$3${4:+-ckpt}
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  /usr/bin/time -f "$name %e s" deepcompile-remat compare --model $1 --layers 4 --hidden 256 --heads 4 --seq $3 --steps 20 --warmup 3 --no-plots --quiet --precisions $2 $4 --peers $P --out $name
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
done
