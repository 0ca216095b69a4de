#!/usr/bin/env bash
# The serving benchmarks behind docs/benchmarks.md, exactly as run there: the three
# `bench compare` presets and a concurrency sweep, on the built-in default model (except
# continuous-vs-static: a 79M random model, see `tokenmill bench make-model`), with the client and
# the servers on this machine's loopback. Everything runs under `nice`, one server
# at a time; results land in $OUT (default benchmarks/results/serving).
#
#   bash benchmarks/serving.sh            # all of it (about 30 minutes on 2 cores)
#   bash benchmarks/serving.sh sweep      # some parts: machine static prefix chunked sweep
#                                         # (and static_small, not part of the default run)
set -euo pipefail

OUT=${OUT:-benchmarks/results/serving}
NICE=(nice -n 10)
# SLOs for goodput and the knee, sized for a small random model on a laptop-class CPU.
SLO=(--goodput ttft:1000 tpot:25)
SLO_79M=(--goodput ttft:2000 tpot:150)  # the 79M model streams ~5x slower
# Each configuration runs 3 times, interleaved with the others'; tables show the medians.
REPEATS=(--repeats 3)
mkdir -p "$OUT"

machine() {
  {
    date -u +"%Y-%m-%d %H:%M UTC"
    lscpu | grep -E "^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket)"
    python -c "import torch, tokenmill; print('torch', torch.__version__, '| tokenmill', tokenmill.__version__)"
    echo "load average before the runs: $(cut -d' ' -f1-3 /proc/loadavg)"
  } | tee "$OUT/machine.txt"
}

static() {  # continuous batching vs the static-batching baseline, sharegpt-like lengths
  # A 79M-parameter random model, so that the forward pass (what batching shares) dominates
  # the cost of a token rather than the HTTP streaming around it.
  local model
  model=$(tokenmill bench make-model --preset bench)
  "${NICE[@]}" tokenmill bench compare --preset continuous-vs-static --model "$model" \
    --num-prompts 64 "${SLO_79M[@]}" "${REPEATS[@]}" --disable-tqdm \
    --output-dir "$OUT/continuous-vs-static"
  # the same at a Poisson rate of 1 req/s: continuous has headroom, static is near capacity
  "${NICE[@]}" tokenmill bench compare --preset continuous-vs-static --model "$model" \
    --num-prompts 64 --request-rate 1 "${SLO_79M[@]}" "${REPEATS[@]}" --disable-tqdm \
    --output-dir "$OUT/continuous-vs-static-rate1"
}

static_small() {  # the same on the built-in 4M model (not run by default; see the docs)
  "${NICE[@]}" tokenmill bench compare --preset continuous-vs-static --num-prompts 128 \
    "${SLO[@]}" "${REPEATS[@]}" --disable-tqdm --output-dir "$OUT/continuous-vs-static-small"
  "${NICE[@]}" tokenmill bench compare --preset continuous-vs-static --num-prompts 128 \
    --request-rate 3 "${SLO[@]}" "${REPEATS[@]}" --disable-tqdm \
    --output-dir "$OUT/continuous-vs-static-small-rate3"
}

prefix() {  # automatic prefix caching on vs off, 768 shared tokens + 32 per request
  "${NICE[@]}" tokenmill bench compare --preset prefix-caching --num-prompts 64 \
    "${REPEATS[@]}" --disable-tqdm --output-dir "$OUT/prefix-caching"
}

chunked() {  # chunked prefill on vs off: 1536-token documents among chat requests
  "${NICE[@]}" tokenmill bench compare --preset chunked-prefill --num-prompts 96 \
    "${REPEATS[@]}" --disable-tqdm --output-dir "$OUT/chunked-prefill"
}

sweep() {  # one continuous-batching server, concurrency 1..64: where is the knee?
  local port log pid
  port=$(python -c "from tokenmill.bench.server_process import free_port; print(free_port())")
  log="$OUT/sweep/server.log"
  mkdir -p "$OUT/sweep"
  "${NICE[@]}" tokenmill serve --host 127.0.0.1 --port "$port" --max-num-seqs 64 \
    --disable-uvicorn-access-log >"$log" 2>&1 &
  pid=$!
  trap 'kill "$pid" 2>/dev/null || true' RETURN
  for _ in $(seq 1 300); do  # at most 150 s for the server to come up
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$pid" 2>/dev/null || { echo "server died; see $log"; return 1; }
    sleep 0.5
  done
  "${NICE[@]}" tokenmill bench sweep --base-url "http://127.0.0.1:$port" \
    --dataset-name sharegpt-like --sharegpt-scale 0.25 --num-prompts 64 \
    --max-concurrency-list 1,2,4,8,16,32,64 "${SLO[@]}" --disable-tqdm \
    --save-result "$OUT/sweep/sweep.json" --plot "$OUT/sweep" | tee "$OUT/sweep/table.txt"
}

if [ $# -eq 0 ]; then
  machine; static; prefix; chunked; sweep
else
  for part in "$@"; do "$part"; done
fi
