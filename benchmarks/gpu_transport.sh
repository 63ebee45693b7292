#!/usr/bin/env bash
# The GPU matrix of `disagg bench transport`, one device call per machine.
#
#   bash benchmarks/gpu_transport.sh 2      # 2 GPUs: 1 -> 1 for qwen2-0.5b, qwen2-1.5b, qwen2-7b
#   bash benchmarks/gpu_transport.sh 4      # 4 GPUs: 1 -> 3 for the three shapes; 2 -> 2 gather and shards, qwen2-7b
#   bash benchmarks/gpu_transport.sh smoke  # 2 GPUs: 1 -> 1 for tiny and qwen2-0.5b (does the CUDA path work?)
#   bash benchmarks/gpu_transport.sh 4a     # 4 GPUs, first half: the GPU tests, then 1 -> 3 for the three shapes
#   bash benchmarks/gpu_transport.sh 4b     # 4 GPUs, second half: 2 -> 2 gather and shards (7B), 1 -> 1 (three shapes)
#   bash benchmarks/gpu_transport.sh 4c|4d|4e  # 4 GPUs: the re-runs after fixes (see the case arms below)
#   bash benchmarks/gpu_transport.sh 5a|5b|5c  # 4 GPUs: the final matrix (timeline + tests + 1 -> 3; 2 -> 2 and 1 -> 1; gather)
#
# Run from the repository root. On a GPU machine without the package installed,
# send `.device` along (carry, built here by ../shared/tools/device-bundle): the
# script unpacks Ray and Hydra from it. Every run verifies the receivers bit for
# bit (--check). One JSON report per run and the whole log go into $OUT
# (default ./bench-out); a failed run is logged and the others still run.
set -uo pipefail
matrix=${1:?usage: gpu_transport.sh 2|4|smoke}
out=${OUT:-bench-out}
mkdir -p "$out"
log="$out/transport.log"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import ray" 2>/dev/null; then
  [ -f .device/bundle.tar.xz ] || { echo "ray is missing and .device/bundle.tar.xz was not sent" >&2; exit 2; }
  mkdir -p /tmp/site && tar -xJf .device/bundle.tar.xz -C /tmp/site
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"

failed=0
bench() {  # bench NAME FLAGS...: one run, its report in $out/NAME.json
  local name=$1; shift
  echo "=== $name: disagg bench transport $*" | tee -a "$log"
  timeout "${BENCH_LIMIT_S:-240}" python3 -m disagg bench transport --device cuda --check --timeout-s 60 \
    --json "$out/$name.json" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then echo "=== $name failed (exit $rc)" | tee -a "$log"; failed=1; fi
}

case "$matrix" in
  smoke)
    bench tiny_1to1 --shape tiny
    bench qwen2-0.5b_1to1 --shape qwen2-0.5b ;;
  2)
    for shape in qwen2-0.5b qwen2-1.5b qwen2-7b; do bench "${shape}_1to1" --shape "$shape"; done ;;
  4)
    for shape in qwen2-0.5b qwen2-1.5b qwen2-7b; do bench "${shape}_1to3" --shape "$shape" --receivers 3; done
    for source in gather shards; do
      bench "qwen2-7b_2to2_$source" --shape qwen2-7b --trainer-ranks 2 --receivers 2 --source "$source"
    done ;;
  4a)
    if python3 -c "import pytest" 2>/dev/null; then
      python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee -a "$log" "$out/gpu_tests.log" | tail -5
    else
      echo "pytest missing: GPU tests not run" | tee -a "$log"
    fi
    for shape in qwen2-0.5b qwen2-1.5b qwen2-7b; do bench "${shape}_1to3" --shape "$shape" --receivers 3; done ;;
  4b)
    for source in gather shards; do
      bench "qwen2-7b_2to2_$source" --shape qwen2-7b --trainer-ranks 2 --receivers 2 --source "$source"
    done
    for shape in qwen2-0.5b qwen2-1.5b qwen2-7b; do bench "${shape}_1to1" --shape "$shape"; done
    # Bucket size against the per-op pipeline drain (1 -> 3; (e) is in the 4a runs).
    for mb in 512 2048; do bench "qwen2-7b_1to3_b$mb" --shape qwen2-7b --receivers 3 --bucket-mb $mb --skip e; done
    bench "qwen2-1.5b_1to3_b1024" --shape qwen2-1.5b --receivers 3 --skip e ;;
  4c)  # after the shards deadlock fix: 2 -> 2 shards (7B), then 1 -> 1 for the three shapes
    bench qwen2-7b_2to2_shards --shape qwen2-7b --trainer-ranks 2 --receivers 2 --source shards --skip e
    for shape in qwen2-0.5b qwen2-1.5b qwen2-7b; do bench "${shape}_1to1" --shape "$shape" --skip e; done ;;
  4d)  # after the cross-stream allocator fix: GPU tests, 2 -> 2 shards (7B), 1 -> 3 (7B) with 1 GiB buckets
    python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee -a "$log" "$out/gpu_tests.log" | tail -3
    bench qwen2-7b_2to2_shards --shape qwen2-7b --trainer-ranks 2 --receivers 2 --source shards --skip e
    bench qwen2-7b_1to3_b1024 --shape qwen2-7b --receivers 3 --skip e ;;
  4e)  # the in-place FSDP gather (after 2026-11-21's runs): 2 -> 2 gather, and 1 -> 3 for 1.5B with 1 GiB buckets
    bench qwen2-7b_2to2_gather --shape qwen2-7b --trainer-ranks 2 --receivers 2 --source gather --skip e
    bench qwen2-1.5b_1to3_b1024 --shape qwen2-1.5b --receivers 3 --skip e ;;
  5a)  # after the fixed-cost cuts (cached bucket views, header off the critical path, no split of
       # tensors that fit a bucket): a per-rank timeline, the GPU tests, 1 -> 3 for the three shapes
    for a in "qwen2-1.5b 3" "qwen2-7b 3"; do
      set -- $a
      timeout 150 python3 benchmarks/profile_sync.py --shape "$1" --receivers "$2" --bucket-mb 1024 --out /tmp/prof 2>&1 \
        | grep -v -e USDT -e "^   kernels" | cut -c1-600 | tee -a "$log"
    done
    python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee -a "$log" "$out/gpu_tests.log" | tail -3
    for shape in qwen2-0.5b qwen2-1.5b qwen2-7b; do bench "${shape}_1to3" --shape "$shape" --receivers 3; done ;;
  5b)  # the same code: 2 -> 2 gather and shards (7B), 1 -> 1 for the three shapes
    for source in gather shards; do
      bench "qwen2-7b_2to2_$source" --shape qwen2-7b --trainer-ranks 2 --receivers 2 --source "$source" --skip e
    done
    for shape in qwen2-0.5b qwen2-1.5b qwen2-7b; do bench "${shape}_1to1" --shape "$shape" --skip e; done ;;
  5c)  # after gathering the parts of tensors larger than a bucket in place: GPU tests, 2 -> 2 gather (7B)
    python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee -a "$log" "$out/gpu_tests.log" | tail -3
    bench qwen2-7b_2to2_gather --shape qwen2-7b --trainer-ranks 2 --receivers 2 --source gather --skip e ;;
  *) echo "unknown matrix $matrix (2, 4, 4a-4e, 5a-5c or smoke)" >&2; exit 2 ;;
esac
exit $failed
