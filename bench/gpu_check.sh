#!/usr/bin/env bash
# The GPU checks and figures in one pass, on a machine with a CUDA build of torch:
#   tests   the tests that need the real device (pytest -m gpu);
#   main    the main job on a GPU, from the command line (it must exit 0 and match the in-memory tokens);
#   dense   the dense 3.4b preset with max_memory.0=1.5GB: in memory, prefetch, graphs, hybrid, the lossless codec;
#   trace   a profiler trace of one decoding token of that model (where the host and the GPU spend it);
#   moe     the mixtral-2.6g checkpoint of bench/moe.py, a quarter of it on GPU 0;
#   codec   the lossless codec's ratio and decoding rate on the GPU;
#   diffusion  a diffusers pipeline against diffusers' own offload modes at the same GPU memory;
#   dense11 the dense 1.1b preset with max_memory.0=1GB (the earlier reports' model);
#   dequant the GGUF dequantization kernels as device ops (GB/s of float32 written);
#   quantized  bitsandbytes/torchao checkpoints over a GPU budget, ours against transformers' device_map offloading;
#   gguf    a 1.1B synthetic Llama with 0.6 GB on the GPU: bf16 from pinned memory against its Q4_0 GGUF (the blocks
#           cross PCIe quantized, dequantized on the GPU) and quantized compute.
# Usage: bash bench/gpu_check.sh [stages...]  (default: tests main dense trace moe codec diffusion); QUICK=1 runs
# fewer tokens and one repetition (a first look). Figures go to $OUT (default bench/results), the log to
# $OUT/gpu_check.log. Wheels in .whl/ (hydra-core, omegaconf, antlr4, sybil, diffusers, gguf) are installed first.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
export PYTHONUNBUFFERED=1 OFFLOAD_CORE_CACHE=${OFFLOAD_CORE_CACHE:-/tmp/offload-gpu-cache}
PY=${PYTHON:-python3}
stages=${*:-tests main dense trace moe codec diffusion}
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
if [ -n "${QUICK:-}" ]; then TOKENS=16 REPS=1 PRESET=${PRESET:-1.1b} BUDGET=${BUDGET:-1GB}; else
    TOKENS=32 REPS=2 PRESET=${PRESET:-3.4b} BUDGET=${BUDGET:-1.5GB}; fi
P=ours:prefetch:pinned_cpu
DENSE_SYSTEMS=${DENSE_SYSTEMS:-inmem,inmem-static,inmem-graphs,$P,$P:graphs,$P:hybrid,$P+codec=exponent}
MOE_SYSTEMS=${MOE_SYSTEMS:-inmem,ours:experts:pinned_cpu,ours:prefetch:pinned_cpu,ours:experts+guess=none:pinned_cpu}

for stage in $stages; do
    echo "== stage $stage ($(date +%T))"
    case $stage in
    tests)
        timeout ${TESTS_TIMEOUT:-240} $PY -m pytest -q -m gpu -n 8 -p no:cacheprovider -W ignore $(grep -rlE "pytest.mark.gpu" tests --include="test_*.py") >"$OUT/gpu_tests.txt" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -30
        ;;
    main)
        timeout 120 $PY run.py model=synthetic model.preset=small max_memory.0=64MB storage=pinned_cpu hook=prefetch \
            max_new_tokens=8 compare_in_memory=true progress=false hydra.run.dir=/tmp/gpu-main
        echo "exit $?"
        timeout 120 $PY run.py model=synthetic model.preset=small max_memory.0=64MB storage=pinned_cpu hook=prefetch graphs=true \
            max_new_tokens=8 compare_in_memory=true progress=false hydra.run.dir=/tmp/gpu-graphs
        echo "exit $? (graphs)"
        ;;
    dense)
        timeout 360 $PY bench/compare.py --preset "$PRESET" --device cuda --budget "$BUDGET" --tokens "$TOKENS" \
            --reps "$REPS" --timeout 150 --code worktree --out "$OUT" --tag "$PRESET-cuda-$SLUG" \
            --systems "$DENSE_SYSTEMS" --note "$NOTE"
        ;;
    trace)
        timeout 120 $PY bench/gpu_trace.py --preset "$PRESET" --budget "$BUDGET" --out "$OUT" --tag "$PRESET-cuda-$SLUG"
        timeout 120 $PY run.py model=synthetic model.preset="$PRESET" max_memory.0="$BUDGET" storage=pinned_cpu \
            hook=prefetch hybrid=true plan_only=true progress=false hydra.run.dir=/tmp/gpu-hybrid-plan
        ;;
    moe)
        $PY -c "import sys; sys.path.insert(0, 'bench'); import moe; print(moe.build('mixtral-2.6g'))"
        timeout 300 $PY bench/compare.py --checkpoint "$OFFLOAD_CORE_CACHE/moe-mixtral-2.6g" --device cuda \
            --budget 0.65GB --tokens "$TOKENS" --reps "$REPS" --timeout 120 --code worktree --out "$OUT" \
            --tag "moe-mixtral-2.6g-cuda-$SLUG" --systems "$MOE_SYSTEMS" \
            --note "$NOTE" --note "a quarter of the model on GPU 0 (max_memory.0), the rest in host memory"
        ;;
    codec)
        timeout 120 $PY bench/gpu_codec.py --device cuda --preset "$PRESET" --no-smollm2 --out "$OUT" \
            --tag "cuda-$SLUG"
        ;;
    diffusion)
        timeout 240 $PY bench/diffusion.py --device cuda --out "$OUT" --timeout 120 --reps "$REPS"
        ;;
    dequant)
        timeout 60 $PY bench/dequant.py --elements 4000000 --repeats 3 --tag "cuda-$SLUG" --out "$OUT"
        ;;
    quantized)
        timeout 240 $PY bench/quantized_peers.py --device cuda --tokens "$TOKENS" --timeout 60 --out "$OUT" \
            --scratch /tmp/offload-quantized-bench
        ;;
    gguf)
        timeout 420 $PY bench/gguf_large.py --scratch /tmp/gguf-gpu --preset 1b --types Q4_0 --device cuda \
            --budget 0.6GB --tokens "$TOKENS" --warm --margin-gb 2 --tag "1b-cuda-$SLUG" --results "$OUT"
        ;;
    dense11)
        timeout 300 $PY bench/compare.py --preset 1.1b --device cuda --budget 1GB --tokens "$TOKENS" --reps "$REPS" \
            --timeout 120 --code worktree --out "$OUT" --tag "1.1b-cuda-$SLUG" \
            --systems inmem,ours:prefetch:pinned_cpu,ours:functional_call:pinned_cpu --note "$NOTE"
        ;;
    esac
done
echo "== done ($(date +%T)); load $(cut -d' ' -f1-3 /proc/loadavg)"
