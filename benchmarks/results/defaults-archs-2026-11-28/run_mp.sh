# The autocast cells with HF checkpointing where our autocast peak is above FSDP2's, against
# dcr.compile with FSDP2's own mixed precision (zero3.shard(param_dtype=bf16): bf16 weights and
# activations, fp32 shards and reduce; ours-compile-mp), each cell on a fresh inductor cache.
# Usage: bash run_mp.sh [OUT] (default: results land beside this script)
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "${1:-$here}" && cd "${1:-$here}"
P="ours-compile ours-compile-mp fsdp2-block-compiled"
for cell in "gemma2 1024" "phi3 2048" "llama 2048"; do
  set -- $cell
  model=$here/$1.json; [ "$1" = llama ] && model="llama --layers 4 --hidden 256 --heads 4"
  name=r1-$1-mp-$2-ckpt
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  /usr/bin/time -f "$name %e s" deepcompile-remat compare --model $model --seq $2 \
    --steps 20 --warmup 3 --no-plots --quiet --precisions autocast --checkpointing --peers $P \
    --out $name
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
done
