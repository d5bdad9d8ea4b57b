# The default entry points at three architectures the earlier tables do not name (transformers
# configs in this folder: phi3, gemma2, gpt_neox at 4x256, random weights), against FSDP2 +
# per-block compile and DeepSpeed: seq 1024 autocast with and without HF checkpointing, bf16,
# and seq 2048 with checkpointing; each cell on a fresh inductor cache. The second run of phi3
# seq 1024 bf16 (r2-phi3-bf16-1024/): the same compare with --peers ours-deepspeed
# fsdp2-block-compiled ours-deepspeed-bf16-master --out r2-phi3-bf16-1024.
# Usage: bash run.sh [OUT] (default: results land beside this script)
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "${1:-$here}" && cd "${1:-$here}"
P="ours-deepspeed ours-compile fsdp2-block-compiled deepspeed-lean"
for cell in "phi3 autocast 1024" "phi3 autocast 1024 --checkpointing" "phi3 bf16 1024" \
            "phi3 autocast 2048 --checkpointing" "phi3 bf16 2048 --checkpointing" \
            "gemma2 autocast 1024" "gemma2 autocast 1024 --checkpointing" "gemma2 bf16 1024" \
            "gemma2 bf16 1024 --checkpointing" "gpt_neox bf16 1024"; do
  set -- $cell
  name=r1-$1-$2-$3${4:+-ckpt}
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  /usr/bin/time -f "$name %e s" deepcompile-remat compare --model "$here/$1.json" --seq $3 \
    --steps 20 --warmup 3 --no-plots --quiet --precisions $2 $4 --peers $P --out $name
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
done
