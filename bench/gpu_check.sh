#!/usr/bin/env bash
# The GPU checks and figures in one pass, on a machine with a CUDA build of torch:
#   1. the tests that need the real device (pytest -m gpu);
#   2. the main job on a GPU, from the command line (it must exit 0 and match the in-memory tokens);
#   3. the MoE benchmark on the GPU: the mixtral-2.6g checkpoint of bench/moe.py, a quarter of it on GPU 0;
#   4. (stage "dense") the dense 1.1b benchmark on the GPU.
# Usage: bash bench/gpu_check.sh [stages...]  (default: tests main moe); figures go to $OUT (default bench/results),
# the log to $OUT/gpu_check.log. Wheels in .whl/ (hydra-core, omegaconf, antlr4, sybil) are installed first if there.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
export PYTHONUNBUFFERED=1 OFFLOAD_CORE_CACHE=${OFFLOAD_CORE_CACHE:-/tmp/offload-gpu-cache}
PY=${PYTHON:-python3}
stages=${*:-tests main moe}
exec > >(tee -a "$LOG") 2>&1

if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c "import offload_core_plugins" 2>/dev/null ||
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . ||
    { echo "could not install offload_core"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name(0))")
SLUG=$(echo "$GPU" | grep -o -i -E 'h100|h200|a100|l40s|l4|a10g|t4' | head -1 | tr 'A-Z' 'a-z')
NOTE="$GPU (one GPU), $(nproc) CPUs, torch $($PY -c 'import torch; print(torch.__version__)'), transformers $($PY -c 'import transformers; print(transformers.__version__)')"
echo "== $NOTE; load $(cut -d' ' -f1-3 /proc/loadavg)"

for stage in $stages; do
    echo "== stage $stage ($(date +%T))"
    case $stage in
    tests)
        timeout 240 $PY -m pytest -q -m gpu -n 8 -p no:cacheprovider \
            tests/module_hooks/test_prefetch_gpu.py tests/module_hooks/test_experts_gpu.py \
            tests/speculative/test_policies.py
        ;;
    main)
        timeout 120 $PY run.py model=synthetic max_memory.0=1MB storage=pinned_cpu hook=prefetch \
            max_new_tokens=8 compare_in_memory=true progress=false hydra.run.dir=/tmp/gpu-main
        echo "exit $?"
        ;;
    moe)
        $PY -c "import sys; sys.path.insert(0, 'bench'); import moe; print(moe.build('mixtral-2.6g'))"
        timeout 420 $PY bench/compare.py --checkpoint "$OFFLOAD_CORE_CACHE/moe-mixtral-2.6g" --device cuda \
            --budget 0.65GB --tokens 16 --reps 2 --timeout 120 --code worktree --out "$OUT" \
            --tag "moe-mixtral-2.6g-cuda-$SLUG" \
            --systems inmem,accelerate,ours:experts:pinned_cpu,ours:prefetch:pinned_cpu,ours:experts:safetensors,ours:prefetch:safetensors \
            --note "$NOTE" --note "a quarter of the model on GPU 0 (max_memory.0), the rest in host memory"
        ;;
    dense)
        timeout 300 $PY bench/compare.py --preset 1.1b --device cuda --budget 1GB --tokens 32 --reps 2 \
            --timeout 120 --code worktree --out "$OUT" --tag "1.1b-cuda-$SLUG" \
            --systems inmem,accelerate,ours:prefetch:pinned_cpu,ours:functional_call:pinned_cpu,ours:prefetch:safetensors \
            --note "$NOTE"
        ;;
    esac
done
echo "== done ($(date +%T)); load $(cut -d' ' -f1-3 /proc/loadavg)"
