# The checkpointed cells where a default entry point peaks above FSDP2 + per-block compile, run
# again with FSDP2's own arithmetic on our side, each cell on a fresh inductor cache:
#   mp:          autocast cells against dcr.compile with zero3.shard(param_dtype=bf16)
#                (ours-compile-mp: bf16 weights and activations, fp32 shards and reduce);
#   bf16-master: bf16 cells against the takeover and stock DeepSpeed with DeepSpeed's
#                bf16_master_weights_and_grads and bf16_optimizer_states keys.
# Usage: bash run_matched.sh [OUT] (default: results land beside this script)
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "${1:-$here}" && cd "${1:-$here}"
cell() {  # cell TAG PRECISION "PEERS" ARCH SEQ
  local model=$here/$4.json
  [ "$4" = llama ] && model="llama --layers 4 --hidden 256 --heads 4"
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  /usr/bin/time -f "r1-$4-$1-$5-ckpt %e s" deepcompile-remat compare --model $model --seq "$5" \
    --steps 20 --warmup 3 --no-plots --quiet --precisions "$2" --checkpointing --peers $3 \
    --out "r1-$4-$1-$5-ckpt"
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
}
MP="ours-compile ours-compile-mp fsdp2-block-compiled"
MASTER="ours-deepspeed-bf16-master fsdp2-block-compiled deepspeed-lean-bf16-master"
for arch_seq in "gemma2 1024" "phi3 2048" "llama 2048"; do cell mp autocast "$MP" $arch_seq; done
for arch_seq in "gemma2 1024" "phi3 2048" "llama 1024"; do
  cell bf16-master bf16 "$MASTER" $arch_seq
done
