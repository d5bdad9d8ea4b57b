# The takeover's step against FSDP2 + per-block compile at phi3 seq 1024 bf16 (the cell whose
# first two runs, r1 and r2, measured 1.09x and 1.10x): three rounds, each pair run twice in
# both orders, each compare on a fresh inductor cache. Usage: bash run_rounds.sh [OUT]
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "${1:-$here}" && cd "${1:-$here}"
for i in 1 2 3; do
  for peers in "ours-deepspeed fsdp2-block-compiled" "fsdp2-block-compiled ours-deepspeed"; do
    name=rounds-phi3-bf16-1024/r$i-${peers%% *}-first
    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    deepcompile-remat compare --model "$here/phi3.json" --seq 1024 --steps 20 --warmup 3 \
      --no-plots --quiet --precisions bf16 --peers $peers --out $name > /dev/null
    grep -E "^bf16" $name/table.txt
    rm -rf "$TORCHINDUCTOR_CACHE_DIR"
  done
done
