#!/usr/bin/env bash
# The GPU checks in one go, on a machine with an NVIDIA GPU and CuPy (the project installed or importable):
#
#   bash scripts/gpu_checks.sh OUTDIR [STAGE ...]
#
# Stages (default: all, in this order, each under its own time limit so one that hangs leaves the rest):
#   info       nvidia-smi and CuPy's configuration
#   tests      the tests marked gpu (pytest -m gpu tests/test_gpu.py): CuPy against the CPU, real GPU
#              out-of-memory split, a real broken CUDA context restarted, memory measured on the device
#   memory     python -m benchmarks.studies.gpu_memory: CuPy's pool and NVML against known allocations, per operator
#   bench      python -m benchmarks.gpu: gst3d_dip over a survey too large for the GPU in one piece
#   operators  python -m benchmarks.studies.operator_memory --device both: every operator on the CPU and the GPU
#   demo       memchunk demo (on the GPU where there is one)
#   dask-cuda  the runner's own cluster as dask-cuda's LocalCUDACluster (the gpu-cluster extra): the gpu test that
#              runs a map on it; DASK_CUDA_SITE, where set, is a folder put first on PYTHONPATH for this stage
#              (dask-cuda pins its own dask and distributed release: pip install --target it apart)
#
# Environment: TESTS_K (a pytest -k expression), BENCH_ARGS (e.g. "--shape 512 512 400 --gpu-memory-limit 17179869184"),
# TESTS_LIMIT, BENCH_LIMIT, DEMO_LIMIT (seconds).
# The tests run verbose (-v: each test is named as it starts, so a stage cut off by its limit shows which test
# it was in) with every duration at the end.
# Everything goes to OUTDIR/checks.log (one file: the device tool returns at most 8) and the benchmarks' JSON
# beside it. Real SEG-Y test files are looked for in $MEMCHUNK_SEGY_TEST_DATA (else ../shared/data/segy).
set -u
out=${1:?usage: scripts/gpu_checks.sh OUTDIR [STAGE ...]}
shift
mkdir -p "$out"
stages=${*:-info tests memory bench operators demo}
export PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
log="$out/checks.log"

run() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "=== $name (limit ${limit} s): $*" | tee -a "$log"
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  echo "=== $name: rc $rc in $(( $(date +%s) - start )) s" | tee -a "$log"
}

for stage in $stages; do
  case $stage in
    info) run info 60 bash -c 'nvidia-smi; python3 -c "import cupy; cupy.show_config()"' ;;
    tests) run tests "${TESTS_LIMIT:-240}" python3 -m pytest -v --durations=0 -m gpu tests/test_gpu.py -p no:cacheprovider -rs \
             ${TESTS_K:+-k "$TESTS_K"} ;;
    memory) run memory 120 python3 -m benchmarks.studies.gpu_memory --json "$out/gpu_memory.json" ;;
    bench) run bench "${BENCH_LIMIT:-330}" python3 -m benchmarks.gpu ${BENCH_ARGS:-} --json "$out/gpu_bench.json" ;;
    operators) run operators 180 python3 -m benchmarks.studies.operator_memory --device both --shape 128 128 400 \
                 --json "$out/operators.json" ;;
    demo) run demo "${DEMO_LIMIT:-180}" python3 -m memchunk_prefect.cli.main demo ;;
    dask-cuda) run dask-cuda "${TESTS_LIMIT:-240}" env PYTHONPATH="${DASK_CUDA_SITE:+$DASK_CUDA_SITE:}${PYTHONPATH:-}" \
                 bash -c 'python3 -c "import dask, distributed, dask_cuda; print(\"dask\", dask.__version__, \"distributed\",
                   distributed.__version__, \"dask-cuda\", dask_cuda.__version__)"; python3 -m pytest -v -m gpu -rs \
                   -p no:cacheprovider tests/test_gpu.py -k dask_cuda' ;;
    *) echo "unknown stage $stage (info tests memory bench operators demo dask-cuda)" | tee -a "$log" ;;
  esac
done
