#!/usr/bin/env bash
# The CUDA checks (the `gpu` tests, the GPU benchmarks, the replay on CUDA), ready for a
# GPU machine without network access.
#
# On a machine with network (once): fetch the wheels a typical GPU image lacks into .whl/
# (ignored by git through .git/info/exclude). The image this targets has Python 3.12,
# torch 2.11+cu130, CuPy, cuda-toolkit with cuFile, pytest, hypothesis, xxhash, typer,
# rich, prometheus-client and matplotlib; it lacks lmdb, crc32c and KvikIO:
#
#     bash tools/cuda_checks.sh fetch
#
# On the GPU machine, from the repository root, with .whl carried along (each step fits
# in 10 minutes; logs and tables go to $OUT, else /tmp/cuda-checks):
#
#     bash tools/cuda_checks.sh tests     # the `gpu` tests, then the whole suite (vLLM's skip)
#     bash tools/cuda_checks.sh bench     # GPU<->CPU handlers (consecutive, then shuffled CPU slots),
#                                         # then the disk tier through KvikIO
#     bash tools/cuda_checks.sh replay    # the whole hierarchy with the device cache on CUDA
#     bash tools/cuda_checks.sh all       # the gpu tests, both benches and the replay in one
#                                         # command under 10 minutes, each step time-limited
#
# Record what they print in docs/benchmarks.md ("GPU <-> CPU", "Disk tier"). The project
# is on PYTHONPATH, not installed, so test_console_script_runs_the_demo fails there.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:-}
out=${OUT:-/tmp/cuda-checks}
py=${PYTHON:-python3}

fetch() {
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    mkdir -p .whl
    "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl 'lmdb==3.0.0' 'crc32c==2.9.post0' 'kvikio-cu13==26.10.0' 'libkvikio-cu13==26.10.0' \
        'rapids-logger==0.3.0'
    ls -l .whl
}

install() {
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
    "$py" - <<'EOF' | tee -a "$out/device.txt"
import torch
from tiered_kv.disk.store.io_backends import KvikIOBackend
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("kvikio probe:", KvikIOBackend.probe(".") or "ok")
EOF
}

case "$step" in
    fetch) fetch ;;
    tests)
        install
        failed=0  # run both even if the first fails: the second says what else broke
        "$py" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors 2>&1 | tee "$out/pytest-gpu.txt" || failed=1
        "$py" -m pytest -q -p no:cacheprovider 2>&1 | tee "$out/pytest-all.txt" || failed=1
        exit $failed
        ;;
    bench)
        install
        "$py" tools/bench_gpu_cpu.py 2>&1 | tee "$out/bench_gpu_cpu.txt"
        "$py" tools/bench_gpu_cpu.py --scattered-slots 2>&1 | tee "$out/bench_gpu_cpu_scattered.txt"
        "$py" tools/bench_disk.py --backend kvikio --rounds 3 --plot "$out/bench_disk.png" 2>&1 \
            | tee "$out/bench_disk_kvikio.txt"
        ;;
    all)
        install
        failed=0  # each step under its own limit, so that one that hangs leaves time for the rest
        timeout -s INT 130 "$py" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors 2>&1 | tee "$out/pytest-gpu.txt" || failed=1
        timeout -s INT 150 "$py" tools/bench_gpu_cpu.py 2>&1 | tee "$out/bench_gpu_cpu.txt" || failed=1
        timeout -s INT 60 "$py" tools/bench_gpu_cpu.py --scattered-slots 2>&1 \
            | tee "$out/bench_gpu_cpu_scattered.txt" || failed=1
        timeout -s INT 150 "$py" tools/bench_disk.py --backend kvikio --rounds 1 --dir /tmp/bench-disk \
            --plot "$out/bench_disk.png" 2>&1 | tee "$out/bench_disk_kvikio.txt" || failed=1
        timeout -s INT 90 "$py" tools/replay.py --workload chat --gpu --markdown "$out/replay_gpu.md" 2>&1 \
            | tee "$out/replay_gpu.txt" || failed=1
        exit $failed
        ;;
    replay)
        install
        "$py" tools/replay.py --workload chat --gpu --markdown "$out/replay_gpu.md" 2>&1 \
            | tee "$out/replay_gpu.txt"
        ;;
    *)
        echo "usage: bash tools/cuda_checks.sh fetch|tests|bench|replay|all" >&2
        exit 2
        ;;
esac
