# Step times of DeepSpeed's offload configs, stock (lean knobs) against the takeover, on a
# machine whose bf16 matmuls are fast (AVX-512 BF16): issue 42's "no offload step times".
cd "$(dirname "$0")"
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
/usr/bin/time -f "%e s wall" deepcompile-remat compare --model llama --layers 4 --hidden 512 \
  --seq 1024 --steps 10 --warmup 2 --no-plots --quiet --precisions bf16 autocast \
  --peers ours-deepspeed-offload deepspeed-lean-offload ours-deepspeed-offload-params \
  deepspeed-lean-offload-params ours-deepspeed-offload-all deepspeed-lean-offload-all \
  ours-deepspeed deepspeed-lean --out .
rm -rf "$TORCHINDUCTOR_CACHE_DIR"
