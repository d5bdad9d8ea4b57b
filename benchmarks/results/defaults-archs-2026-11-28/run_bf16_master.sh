# "bf16" with DeepSpeed's own pure-bf16 keys (bf16_master_weights_and_grads,
# bf16_optimizer_states): the takeover and stock DeepSpeed against FSDP2 + per-block compile on
# bf16 parameters (no fp32 master either), with HF checkpointing; each cell on a fresh cache.
# Usage: bash run_bf16_master.sh [OUT] (default: results land beside this script)
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "${1:-$here}" && cd "${1:-$here}"
P="ours-deepspeed-bf16-master fsdp2-block-compiled deepspeed-lean-bf16-master"
for cell in "gemma2 1024" "phi3 2048" "llama 1024"; do
  set -- $cell
  model=$here/$1.json; [ "$1" = llama ] && model="llama --layers 4 --hidden 256 --heads 4"
  name=r1-$1-bf16-master-$2-ckpt
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  /usr/bin/time -f "$name %e s" deepcompile-remat compare --model $model --seq $2 \
    --steps 20 --warmup 3 --no-plots --quiet --precisions bf16 --checkpointing --peers $P \
    --out $name
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
done
