# The takeover's step at the cell where it measured 1.06-1.07x FSDP2's (llama 4x256, seq 1024,
# autocast, no checkpointing): ROUNDS rounds of the three systems, each round a fresh compare
# run on a fresh inductor cache, so that a drift of the machine falls on every system.
# Usage: bash run.sh [ROUNDS (default 5)] [OUT] (default: results land beside this script); then
# python ../defaults-avx512-2026-11-28/summarize.py OUT (per round, and the medians).
rounds=${1:-5}
mkdir -p "${2:-$(dirname "$0")}" && cd "${2:-$(dirname "$0")}"
for round in $(seq 1 "$rounds"); do
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  deepcompile-remat compare --model llama --layers 4 --hidden 256 --heads 4 --seq 1024 \
    --steps 20 --warmup 3 --no-plots --quiet --precisions autocast \
    --peers ours-deepspeed ours-compile fsdp2-block-compiled \
    --out r$round-llama-autocast-1024 > /dev/null
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
  grep autocast r$round-llama-autocast-1024/table.txt | head -3
done
