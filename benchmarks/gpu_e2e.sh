#!/usr/bin/env bash
# disagg end to end on the GPU machines, with the real vLLM that ../shared/tools/device-vllm builds.
#
#   bash benchmarks/gpu_e2e.sh tests            # tests/gpu (pytest -m gpu), log in $OUT/gpu_tests.log
#   bash benchmarks/gpu_e2e.sh train NAME ARGS  # `disagg train ARGS`; metrics, log and plot in $OUT/NAME.*
#   bash benchmarks/gpu_e2e.sh bench NAME ARGS  # `disagg bench ARGS --json $OUT/NAME.json`; log in $OUT/NAME.log
#   bash benchmarks/gpu_e2e.sh metrics ARGS     # a short `disagg train ARGS` scraped while it runs: the
#                                               # coordinator's and the engines' /metrics (issue 22)
#   bash benchmarks/gpu_e2e.sh queue FILE       # each line `NAME ARGS` run as `train` (`NAME bench ARGS`:
#                                               # as `bench`; `NAME tests ARGS`: tests/gpu or the tests
#                                               # ARGS name, log NAME.log; `NAME sglang ...`: that line
#                                               # with ENGINE=sglang),
#                                               # one after another,
#                                               # detached (setsid), so the runs outlast the 10-minute call
#   bash benchmarks/gpu_e2e.sh poll SECONDS     # wait for the queue (at most SECONDS), copy the files of
#                                               # finished runs to $OUT; call it again at once to keep the
#                                               # machine warm (it goes back 30 s after a call ends).
#                                               # Files in $OUT are fetched inside those 30 s: three
#                                               # machines went back after a 9-minute poll that brought
#                                               # files (2026-11-27/28). Poll with OUT=/tmp/held (nothing
#                                               # fetched, the log tails still printed) and fetch only
#                                               # in the last call, or when the budget is nearly spent.
#
# Run from the repository root. Carry, besides the vLLM pieces (unpacked here from /tmp/vc, where
# the two calls before put them, as device-vllm's header says): .device/bundle.tar.xz (Ray, Hydra;
# ../shared/tools/device-bundle), .whl/ (disagg's wheel: `pip wheel --no-deps -w .whl .`; vLLM
# finds the `disagg` weight-transfer backend through the wheel's entry point) and
# disagg/control/_proto (the gRPC stubs `make` generated: pytest and `python -m disagg` import the
# working tree's disagg, and the GPU image has no grpcio-tools to generate them). A warm machine
# keeps /tmp/site between calls; it goes back 30 s after a call ends. The third vLLM piece (29 MiB),
# the bundle (28 MiB) and the working tree (~9 MiB) pass a call's 64 MiB together (refused on
# 2026-11-29): carry the bundle in a call of its own that moves it to /tmp/bundle.tar.xz, where
# this script finds it too.
#
# ENGINE=sglang (default vllm): the engines run SGLang 0.5.17 (rollout.engine=sglang). Carry its site
# as well (../shared/tools/device-sglang's piece: .device/sglang, or moved to /tmp/sglang-site.tar.xz);
# it is unpacked into /tmp/site_sgl and put first on PYTHONPATH for these runs only (flashinfer there
# may change vLLM's kernel choices). `train` gets rollout.engine=sglang (a `bench`
# takes it where it takes `train` overrides), and
# `tests` runs tests/gpu/test_sglang_engine.py unless tests are named. The disagg wheel in .whl/ must be
# built from this tree: its entry point sglang.srt.plugins/disagg puts disagg's methods on SGLang's
# scheduler (disagg/rollout/sglang/plugin.py).
set -uo pipefail
stage=${1:?usage: gpu_e2e.sh tests | train NAME ARGS...}
out=${OUT:-bench-out}
mkdir -p "$out" /tmp/site
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  VLLM_ATTENTION_BACKEND=FLASH_ATTN VLLM_USE_FLASHINFER_SAMPLER=0 RAY_DEDUP_LOGS=0
# The logs are filtered line by line (grep --line-buffered): a block-buffered filter left a bench's
# log empty until its end, and a lease that ended mid-run brought nothing of it (2026-12-08).
# Bytecode, as pip writes it at install time: the pieces carry sources only (no .pyc), so without
# this the first process to import vLLM, Ray or a peer compiles them (seconds), and in a `bench peers`
# run the first framework pays it for the ones after it. Once per folder (marker file).
compile_site() {
  [ -f "$1/.disagg-compiled" ] && return 0
  python3 -m compileall -q -j 0 "$1" >/dev/null 2>&1
  touch "$1/.disagg-compiled"
}
if [ ! -d /tmp/site/vllm ]; then
  ls /tmp/vc/part.0* >/dev/null || { echo "vLLM is not unpacked and /tmp/vc holds no pieces" >&2; exit 2; }
  cat /tmp/vc/part.* | xz -T8 -dc | tar -x -C /tmp/site || exit 2
fi
bundle=.device/bundle.tar.xz; [ -f "$bundle" ] || bundle=/tmp/bundle.tar.xz
if [ ! -d /tmp/site/ray ]; then tar -xJf "$bundle" -C /tmp/site || exit 2; fi
# Installed once per wheel: a poll call reinstalling it while a queued run imports it broke that run.
if [ -d .whl ] && ! cmp -s .whl/disagg-*.whl /tmp/site/.disagg-installed.whl; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/disagg-*.whl || exit 2
  cp .whl/disagg-*.whl /tmp/site/.disagg-installed.whl
  python3 -m compileall -q -j 0 /tmp/site/disagg >/dev/null 2>&1
fi
compile_site /tmp/site
# checkpoint-engine, for `disagg bench vllm-sync --peer checkpoint-engine` (a pure-Python wheel; its
# needs - pyzmq, fastapi, pydantic, loguru - come with the vLLM pieces): carried in .whl/ too
for w in .whl/checkpoint_engine-*.whl; do
  [ -f "$w" ] && [ ! -d /tmp/site/checkpoint_engine ] && { python3 -m zipfile -e "$w" /tmp/site || exit 2; }
done
# verl 0.9.1 and TRL 1.16 for `disagg bench peers` (../shared/tools/device-peers' piece, carried as
# .device/peers or moved to /tmp/peers-site.tar.xz): verl's site without TRL (verl imports a class TRL
# 1.16 dropped), TRL in a folder of its own: --verl-site /tmp/site_peers --trl-site /tmp/site_trl:/tmp/site_peers
peers=.device/peers/peers-site.tar.xz; [ -f "$peers" ] || peers=/tmp/peers-site.tar.xz
if [ -f "$peers" ] && [ ! -d /tmp/site_peers/verl ]; then
  mkdir -p /tmp/site_peers /tmp/site_trl && tar -xJf "$peers" -C /tmp/site_peers || exit 2
  mv /tmp/site_peers/trl /tmp/site_peers/trl-*.dist-info /tmp/site_trl/ || exit 2
fi
for d in /tmp/site_peers /tmp/site_trl; do [ -d "$d" ] && compile_site "$d"; done
export PYTHONPATH="/tmp/site:$PWD"
engine_args=()
if [ "${ENGINE:-vllm}" = sglang ]; then
  sgl=.device/sglang/sglang-site.tar.xz; [ -f "$sgl" ] || sgl=/tmp/sglang-site.tar.xz
  if [ ! -d /tmp/site_sgl/sglang ]; then
    mkdir -p /tmp/site_sgl && tar -xJf "$sgl" -C /tmp/site_sgl || { echo "no SGLang site at $sgl" >&2; exit 2; }
  fi
  compile_site /tmp/site_sgl
  export PYTHONPATH="/tmp/site_sgl:$PYTHONPATH"
  engine_args=(rollout.engine=sglang)
  python3 -c "import sglang, sgl_kernel; print('sglang', sglang.__version__)" || exit 2
elif [ "${ENGINE:-vllm}" != vllm ]; then
  echo "ENGINE=$ENGINE: vllm or sglang" >&2; exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, vllm, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'gpus', torch.cuda.device_count())"

case "$stage" in
  tests)
    # tests/gpu unless the arguments name tests of their own (q33's `enginetests` named three and ran
    # the whole suite besides them: 12.6 minutes of a 30-minute lease, 2026-11-30)
    where=tests/gpu
    [ "${ENGINE:-vllm}" = sglang ] && where=tests/gpu/test_sglang_engine.py
    for a in "${@:2}"; do case "$a" in tests/*) where= ;; esac; done
    timeout "${TEST_LIMIT_S:-540}" python3 -m pytest -q -s -p no:cacheprovider --durations=20 $where "${@:2}" 2>&1 \
      | grep --line-buffered -v "nanobind\|leaked \|skipped remainder" | tee "$out/${TESTS_NAME:-gpu_tests}.log"
    exit "${PIPESTATUS[0]}" ;;
  train)
    name=${2:?train needs a NAME}
    shift 2
    timeout "${TRAIN_LIMIT_S:-540}" python3 -m disagg train logging.root_dir=/tmp/runs "hydra.run.dir=/tmp/runs/$name" \
      "${engine_args[@]}" "$@" 2>&1 | grep --line-buffered -v "nanobind\|leaked \|skipped remainder" | tee "$out/$name.log"
    rc=${PIPESTATUS[0]}
    for f in metrics.jsonl reward.png config.json; do
      [ -f "/tmp/runs/$name/$f" ] && cp "/tmp/runs/$name/$f" "$out/$name.$f"
    done
    exit "$rc" ;;
  bench)
    name=${2:?bench needs a NAME}
    shift 2
    timeout "${TRAIN_LIMIT_S:-540}" python3 -m disagg bench "$@" --json "$out/$name.json" 2>&1 \
      | grep --line-buffered -v "nanobind\|leaked \|skipped remainder" | tee "$out/$name.log"
    exit "${PIPESTATUS[0]}" ;;
  metrics)
    # a short run of the default task on the GPU, scraped while it runs (benchmarks/gpu_metrics_check.py)
    rm -rf /tmp/runs/metrics
    timeout "${TRAIN_LIMIT_S:-540}" python3 -m disagg train logging.root_dir=/tmp/runs hydra.run.dir=/tmp/runs/metrics \
      trainer.total_steps=200 "${@:2}" >"$out/metrics_train.log" 2>&1 &
    train=$!
    python3 benchmarks/gpu_metrics_check.py /tmp/runs/metrics "$out/metrics_check.json"
    rc=$?
    python3 -m disagg ctl stop --run-dir /tmp/runs/metrics >/dev/null 2>&1
    wait $train
    grep -v "nanobind\|leaked \|skipped remainder" "$out/metrics_train.log" | tail -n 5
    exit "$rc" ;;
  queue)
    q=/tmp/gpu_queue
    rm -rf "$q"; mkdir -p "$q/out" "$q/repo"
    cp "${2:?queue needs a FILE of lines NAME ARGS}" "$q/runs.txt"
    : >"$q/done.txt"
    # the runs use a snapshot of this tree: a later call brings the working tree as it is then
    tar --exclude=./.device --exclude=./.git -cf - . | tar -xf - -C "$q/repo"
    (cd "$q/repo" && setsid nohup bash -c "while read -r name args; do [ -n \"\$name\" ] || continue; \
      engine=\${ENGINE:-vllm}; case \"\$args \" in sglang\ *) engine=sglang; args=\${args#sglang }; esac; \
      stage=train; case \"\$args \" in bench\ *) stage=bench; args=\${args#bench }; esac; \
      if [ \"\${args%% *}\" = tests ]; then set -- tests \${args#tests}; else set -- \$stage \$name \$args; fi; \
      ENGINE=\$engine OUT=$q/out TRAIN_LIMIT_S=\${QUEUE_LIMIT_S:-3000} TEST_LIMIT_S=\${QUEUE_LIMIT_S:-3000} TESTS_NAME=\$name \
        bash benchmarks/gpu_e2e.sh \"\$@\" >/dev/null 2>&1; \
      echo \"\$name rc=\$?\" >>$q/done.txt; done <$q/runs.txt; echo all >>$q/done.txt" \
      >"$q/queue.log" 2>&1 </dev/null &)
    echo "queued $(grep -c . "$q/runs.txt") runs" ;;
  poll)
    q=/tmp/gpu_queue
    end=$((SECONDS + ${2:?poll needs SECONDS}))
    while [ $SECONDS -lt $end ] && ! grep -qx all "$q/done.txt"; do sleep 10; done
    cat "$q/done.txt"
    for f in "$q"/out/*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 3 "$f"; }; done
    n=0   # at most 8 files come back from a call: metrics first, then logs and plots
    for f in $(ls "$q"/out/*.json "$q"/out/*.metrics.jsonl "$q"/out/*.log "$q"/out/*.reward.png 2>/dev/null); do
      name=$(basename "$f"); name=${name%.metrics.jsonl}; name=${name%.log}; name=${name%.reward.png}
      name=${name%.json}; name=${name%.trace}   # NAME.trace.json: a bench's --trace
      grep -q "^$name rc=" "$q/done.txt" || continue
      [ -e "$q/sent.$(basename "$f")" ] && continue
      [ $n -lt 8 ] || break
      cp "$f" "$out/" && touch "$q/sent.$(basename "$f")" && n=$((n + 1))
    done ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
