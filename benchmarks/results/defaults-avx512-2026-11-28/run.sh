cd "$(dirname "$0")"  # results land beside this script
P="ours-deepspeed ours-compile fsdp2-block-compiled deepspeed-lean"
for round in 1 2; do
for cell in "llama autocast 1024" "llama autocast 1024 --checkpointing" "qwen2 autocast 1024" "qwen2 autocast 1024 --checkpointing" "llama bf16 1024" "llama bf16 1024 --checkpointing" "qwen2 bf16 1024" "qwen2 bf16 1024 --checkpointing" "llama autocast 2048 --checkpointing"; do
  set -- $cell
  name=r$round-$1-$2-$3${4:+-ckpt}
  export TORCHINDUCTOR_CACHE_DIR=/tmp/ti-$name
  /usr/bin/time -f "$name %e s" deepcompile-remat compare --model $1 --layers 4 --hidden 256 --heads 4 --seq $3 --steps 20 --warmup 3 --no-plots --quiet --precisions $2 $4 --peers $P --out $name
done; done
