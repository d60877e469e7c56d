#!/usr/bin/env bash
# GPU figures on a CUDA machine whose Python has torch but not kbit's other dependencies (no network there):
# installs the wheels carried in .whl/ into /tmp/site, then runs the gpu-marked tests and the training benchmark
# per wire format. Logs and JSON go to $OUT (default /tmp/kbit-gpu). Usage:
#   scripts/gpu_check.sh tests
#   scripts/gpu_check.sh bench NAME REPEATS [--set key=value ...]   `kbit bench-train` on profiles/train-gpu.yaml
set -u
out=${OUT:-/tmp/kbit-gpu}
mkdir -p "$out"
if [ ! -f /tmp/site/.kbit-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.kbit-installed || exit 1
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
case "${1:-tests}" in
  tests)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c 'import torch, deepspeed, sys; print(sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "deepspeed", deepspeed.__version__)'
      nproc; } > "$out/env.txt" 2>&1
    python3 -m pytest tests/gpu -v -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
    ;;
  bench)
    name=train_bench_$2 repeats=$3
    shift 3
    python3 -m kbit_core bench-train -c deployments/profiles/train-gpu.yaml --repeats "$repeats" --json "$@" \
      -o "$out/$name.json" 2> "$out/$name.log" > /dev/null
    echo "$name exit $?"; tail -5 "$out/$name.log"
    ;;
esac
