#!/usr/bin/env bash
# Every GPU check and benchmark in one call, for whoever is lent the GPU machine. It runs
# the `gpu`-marked tests, the device benchmark (CUDA tensors: save from and load into the
# GPU against DCP, torch.save and the raw bound), a trainer's first load in fresh
# processes at three `load_staging_bytes` (scripts/first_load.py: pinning included) and
# the 10,000-small-tensors case (issue 44.6, a quiet machine's figures) and
# the 8-rank benchmark, and writes a short report. Nothing to read first:
#
#   here, once:      scripts/gpu_wheels.sh        (fills .whl/ with what that machine lacks)
#   device tool:     run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# The report (gpu_report.md) and the benchmark JSON land in $OUT when it is set (the
# device tool returns them), else in bench-results/. Each step has its own time limit so
# that the whole run fits one 10-minute device call; a step that fails or times out is
# reported and the next one still runs. Exit status: 0 when every step passed.
#
# Without CUDA (here, CI) it runs the same steps at tiny sizes, so the script itself stays
# tested; the GPU tests then skip and the figures mean nothing.
#
#   GPU_CHECK_GIB    state size of the benchmarks, GiB (default 2 with CUDA, 0.05 without:
#                    4 GiB outran the step limits on an H200 machine, whose disk writes
#                    about 0.7-2 GB/s)
#   GPU_CHECK_WORLD  ranks of the multi-rank benchmark (default 8 with CUDA, 2 without)
#   GPU_CHECK_STEPS  the steps to run, by name (default all: gpu_tests device_bench
#                    first_load tiny_bench world<N>_bench), to rerun the ones that failed
#   GPU_CHECK_TINY   1-64 KiB tensors of the one-process tiny case (default 5000 with
#                    CUDA, 200 without: that machine drops the page cache for real, and
#                    10,000 outran its step)
#   GPU_CHECK_SMALL  4 KiB tensors of its small case (default 5000 with CUDA, 200 without)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench-results}"
mkdir -p "$out"
report="$out/gpu_report.md"

python="python3"
if [ -x .venv/bin/python ]; then  # set up here: it has everything, and .whl/ is for 3.12
  python=".venv/bin/python"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
  && ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  echo "a GPU is here but $python's torch has no CUDA (a carried CPU .venv?): not measuring the CPU path" >&2
  exit 1
fi
if "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  cuda=1; gib="${GPU_CHECK_GIB:-2}"; world="${GPU_CHECK_WORLD:-8}"; small="${GPU_CHECK_SMALL:-5000}"; tiny="${GPU_CHECK_TINY:-5000}"
else
  cuda=0; gib="${GPU_CHECK_GIB:-0.05}"; world="${GPU_CHECK_WORLD:-2}"; small="${GPU_CHECK_SMALL:-200}"; tiny="${GPU_CHECK_TINY:-200}"
fi

{
  echo "# shardstore GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo '```'
  "$python" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), f"| {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
  nproc | sed 's/^/cores /'
  echo '```'
  [ "$cuda" = 1 ] || echo "**No CUDA here: the GPU tests skip and the figures below are not GPU figures.**"
} > "$report"

failed=0
step() {  # step NAME SECONDS COMMAND...: runs it with a time limit, logs to $out, adds a line
  local name="$1" limit="$2"; shift 2
  case " ${GPU_CHECK_STEPS:-$name} " in *" $name "*) ;; *) echo "== $name: not in GPU_CHECK_STEPS"; return 0 ;; esac
  local log="$out/${name}.log" start=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=20 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  local verdict="passed"
  [ "$rc" -eq 0 ] || { verdict="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"; failed=1; }
  {
    echo
    echo "## $name: $verdict in ${took}s"
    echo
    echo '```'
    grep -E "passed|failed|skipped|error|Error|x DCP|x raw|x torch|ratio|GB/s|blocked|first load|^  [a-z]" "$log" | tail -n 25
    echo '```'
  } >> "$report"
  tail -n 5 "$log"
}

# only the files holding gpu tests: others may import what that machine lacks (boto3)
mapfile -t gpu_files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
step gpu_tests 150 "$python" -m pytest -q -m gpu -p no:cacheprovider "${gpu_files[@]}"
step device_bench 100 "$python" scripts/bench.py --cases device --world 1 --gib "$gib" --reps 3 \
  --json "$out/bench_device.json"
step first_load 120 "$python" scripts/first_load.py --reps 2
step tiny_bench 120 "$python" scripts/bench.py --cases tiny --tiny "$tiny" --world 1 --reps 3 --json "$out/bench_tiny.json"
step world${world}_bench 150 "$python" scripts/bench.py --world "$world" --gib "$gib" --small "$small" --reps 3 \
  --cases large,reshard,small --json "$out/bench_world${world}.json"

echo
cat "$report"
exit "$failed"
