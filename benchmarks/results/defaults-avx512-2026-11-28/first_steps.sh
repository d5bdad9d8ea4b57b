# The first step (it compiles) of each default entry point against FSDP2 + per-block compile,
# each run alone on a fresh inductor cache, the peers interleaved over rounds so that drift on
# the machine falls on all of them; also the number of C++ kernels inductor compiled (the .so
# files in that cache). Results land in OUT (default: beside this script).
# Usage: bash first_steps.sh LAYERS ROUNDS [OUT] [PRECISION: autocast (default) or bf16]
cd "${3:-$(dirname "$0")}"
layers=${1:-16}; rounds=${2:-3}; precision=${4:-autocast}
for round in $(seq 1 "$rounds"); do
  for peer in fsdp2-block-compiled ours-compile ours-deepspeed; do
    out=first-$layers-$peer-r$round
    cache=$(mktemp -d)
    TORCHINDUCTOR_CACHE_DIR=$cache deepcompile-remat compare --model llama \
      --layers "$layers" --hidden 256 --heads 4 --seq 1024 --steps 1 --warmup 0 --quiet \
      --no-plots --precisions "$precision" --peers "$peer" --out "$out" > /dev/null
    kernels=$(find "$cache" -name "*.so" | wc -l)
    python3 -c "import json,sys; e=json.load(open(sys.argv[1]))['folded'][0]; \
print(sys.argv[2], e['peer'], round(e['first_step_s'], 2), 'kernels', sys.argv[3])" \
      "$out/results.json" "$round" "$kernels"
    rm -rf "$cache"
  done
done
