#!/usr/bin/env bash
# The GPU check (`make gpu-check`; docs/performance.md, "GPU check"):
#
#   bash .ci/gpu_check.sh [OUT_DIR]          # OUT_DIR defaults to build/gpu-check
#
# Without a CUDA device (no nvidia-smi, or none listed) it says so in one line and exits 0;
# a GPU that nvidia-smi lists and torch does not see is a failed stage, not a machine without.
# With one: a venv in build/gpu-venv with torch ($GPU_TORCH_SPEC, default torch==2.13.0, a
# CUDA build on Linux x86_64) and `-e .[test]`, both under constraints.txt where it exists;
# torch must see the device; then the CUDA tests (tests/gpu, GRADBALANCE_GPU_TESTS_DEVICE=cuda
# so that none can pass by skipping), a short benchmarks/step_overhead.py run on the device,
# and the versions of the driver, torch and every package. Every stage runs under `timeout`;
# the summary says where each result is, and the exit status is 1 if any stage failed.
#
# Environment: PYTHON (default python3), GPU_TORCH_SPEC, GPU_PIP_ARGS (more pip arguments,
# e.g. "--no-index --find-links /wheels" on a machine without network access).
set -uo pipefail

caller=$PWD
cd "$(dirname "$0")/.." || exit 1
root=$PWD

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: no CUDA device here (nvidia-smi not found); nothing to run"
    exit 0
fi
gpus=$(timeout 60 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${gpus:-0}" -eq 0 ]; then
    echo "gpu-check: no CUDA device here (nvidia-smi -L lists none); nothing to run"
    exit 0
fi

out=${1:-$root/build/gpu-check}
case $out in /*) ;; *) out=$caller/$out ;; esac  # relative to where the script was called
mkdir -p "$out" && out=$(cd "$out" && pwd) || { echo "gpu-check: cannot create $out"; exit 1; }
# What this script writes there, cleared first so that nothing stale is reported.
rm -f "$out"/{install.log,versions.txt,gpu_tests.log,gpu_tests.xml,summary.txt} \
    "$out"/step_overhead_gpu{.log,_cuda.md,_cuda.json}
python=${PYTHON:-python3}
spec=${GPU_TORCH_SPEC:-torch==2.13.0}
read -r -a pip_args <<<"${GPU_PIP_ARGS:-}"
if [ -f constraints.txt ]; then
    pip_args+=(--constraint "$root/constraints.txt")
fi
venv=$root/build/gpu-venv
py=$venv/bin/python
failed=0
summary=()

# stage NAME SECONDS LOG COMMAND...: runs COMMAND under `timeout`, its output into LOG, and
# records the outcome for the summary.
stage() {
    local name=$1 limit=$2 log=$3 start rc
    shift 3
    echo "gpu-check: $name (at most ${limit} s) ..."
    start=$(date +%s)
    timeout --kill-after=30 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local took=$(( $(date +%s) - start ))
    if [ "$rc" -eq 0 ]; then
        summary+=("ok       $name (${took} s): $log")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        summary+=("TIMEOUT  $name (${limit} s limit): $log")
        failed=1
    else
        summary+=("FAILED   $name (exit $rc, ${took} s): $log")
        failed=1
    fi
    return "$rc"
}

skip() {
    summary+=("skipped  $1: $2")
}

# The venv is reused while it was made from the same torch, constraints and pyproject.toml.
want="$spec ${GPU_PIP_ARGS:-} $(cat constraints.txt pyproject.toml 2>/dev/null | md5sum)"
ready=0
if [ "$(cat "$venv/.gpu-check-spec" 2>/dev/null)" = "$want" ] && "$py" -c "import torch" 2>/dev/null
then
    summary+=("ok       venv: reused $venv")
    ready=1
else
    rm -rf "$venv"
    stage "venv in $venv" 120 "$out/install.log" "$python" -m venv "$venv" &&
    stage "pip install $spec" 1200 "$out/install.log" \
        "$py" -m pip install ${pip_args[@]+"${pip_args[@]}"} "$spec" &&
    stage "pip install -e .[test]" 600 "$out/install.log" \
        "$py" -m pip install ${pip_args[@]+"${pip_args[@]}"} -e ".[test]" &&
    echo "$want" >"$venv/.gpu-check-spec" && ready=1
fi

versions=$out/versions.txt
{ echo "## nvidia-smi"; timeout 60 nvidia-smi; echo; echo "## nvidia-smi -L"; timeout 60 nvidia-smi -L
} >"$versions" 2>&1

cuda_probe='import sys, torch
print("torch", torch.__version__, "CUDA build", torch.version.cuda,
      "cuDNN", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
if not torch.cuda.is_available():
    sys.exit("torch.cuda.is_available() is False")
for i in range(torch.cuda.device_count()):
    print(f"device {i}:", torch.cuda.get_device_name(i), "capability",
          torch.cuda.get_device_capability(i))
torch.ones(1, device="cuda").add_(1)
torch.cuda.synchronize()'
cuda=0
if [ "$ready" -eq 1 ]; then
    echo "## torch" >>"$versions"
    if stage "torch sees the GPU nvidia-smi lists" 120 "$versions" "$py" -c "$cuda_probe"; then
        cuda=1
    fi
    { echo; echo "## pip freeze"; timeout 120 "$py" -m pip freeze; } >>"$versions" 2>&1
else
    skip "torch sees the GPU" "the venv failed"
fi

if [ "$cuda" -eq 1 ]; then
    stage "CUDA tests (tests/gpu)" 300 "$out/gpu_tests.log" \
        env GRADBALANCE_GPU_TESTS_DEVICE=cuda "$py" -m pytest tests/gpu -p no:randomly \
        -p no:cacheprovider -rs --junitxml "$out/gpu_tests.xml"
    # 3 trunks x 2 K, every variant 5 warm-up steps (the passes' timing and auto mode's
    # trials happen there) and 5 timed rounds, then the peak memory at K = 16, each of 9
    # variants per trunk in a fresh process: about 4 minutes on an H200 by an estimate from
    # these sizes, not yet measured.
    stage "step_overhead.py on cuda" 420 "$out/step_overhead_gpu.log" \
        "$py" benchmarks/step_overhead.py --device cuda --trunks mlp,transformer,large \
        --ks 4,16 --rounds 5 --warmup 5 --memory-ks 16 --amortise-ks "" \
        --out "$out" --name step_overhead_gpu
else
    why=$([ "$ready" -eq 1 ] && echo "torch does not see the GPU" || echo "the venv failed")
    skip "CUDA tests" "$why"
    skip "step_overhead.py on cuda" "$why"
fi

{
    echo "gpu-check summary ($(date -u +%FT%TZ), $gpus GPU(s) listed by nvidia-smi):"
    printf '  %s\n' "${summary[@]}"
    echo "  versions (nvidia-smi, torch, pip freeze): $versions"
    if [ -f "$out/step_overhead_gpu_cuda.md" ]; then
        echo "  benchmark: $out/step_overhead_gpu_cuda.md (.json: raw ratios); keep it as"
        echo "    benchmarks/results/step_overhead_gpu_cuda.md"
    fi
    [ -f "$out/gpu_tests.xml" ] && echo "  tests (junit xml): $out/gpu_tests.xml"
    if [ "$failed" -eq 0 ]; then echo "gpu-check: ok"; else echo "gpu-check: FAILED"; fi
} | tee "$out/summary.txt"
exit "$failed"
