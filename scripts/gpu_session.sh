#!/usr/bin/env bash
# Prepared runs for a lent GPU machine (issue #15): kernel correctness, FP8 and GEMV kernels, compile
# seconds unrolled vs scanned, end-to-end decode/prefill on Llama-2-7B shapes (random weights, bf16
# baseline, transformers bf16 static cache beside), kernel speed. All steps take ~18 min of limits:
# split them over two device calls of at most 10 minutes with STEPS, e.g.
#     STEPS="gpu_tests words fp8 kernels" bash scripts/gpu_session.sh   # ~7.7 min
#     STEPS="layout layout_float e2e" bash scripts/gpu_session.sh       # ~6.7 min (then gemv prefill layout_dsf)
# Each step has its own time limit and writes under $OUT (default runs/gpu), so a slow step
# cannot eat the others' time. The machine reaches no registry: carry `git archive HEAD` of this
# project and run from its root through the device tool.
# Its steps ran on an H200 on 2026-11-27 (docs/kernels.md), in two device calls.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu}"
py="${PYTHON:-python}"                   # the interpreter with jax (CUDA), torch and transformers
shapes="${SHAPES:-llama-2-7b}"            # SHAPES / LAYERS: other published shapes or fewer layers (a quick check)
layers=(${LAYERS:+--layers "$LAYERS"})
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
steps="${STEPS:-gpu_tests words fp8 gemv prefill layout layout_dsf layout_float e2e kernels}"  # STEPS: a subset, to split the run over calls
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, its output in $out/NAME.log
  local name=$1 limit=$2
  shift 2
  [[ " $steps " == *" $name "* ]] || return 0
  echo "== [$(( SECONDS - start ))s] $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "   exit $? ; tail:"
  tail -n 25 "$out/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/device.txt" 2>&1
"$py" -c "import jax; print(jax.__version__, jax.devices())" >> "$out/device.txt" 2>&1
cat "$out/device.txt"
step gpu_tests 120 "$py" -m pytest -q -m gpu tests/pallas_kernels/test_gpu_kernels.py
# int4 decode as words of eight K values (pallas_kernels.int4_words, new: 2.1-2.5 SASS instructions per weight
# against the dot kernel's 5.4), on the four shapes of issue #15's int4 target (>= 2.5x bf16 at M <= 16),
# beside the dot kernel (w4g128) and XLA's path; its table entries (kernel int4_words) go to the shipped table.
# Also bf16 weights read as a layer of a stack, as the scan over stacked blocks does: pallas_kernels.float_matmul
# in place against XLA's dynamic slice + dot (bf16_stack, table kernel "float": on by default on a GPU, where
# scripts/gpu_aot.py saw XLA copy each layer's weights out of the stack every decode step).
# --sweep: the word kernel's other tiles, warps, stages and no split at decode rows on 4096x11008.
step words 150 "$py" scripts/bench_kernels.py --reps 10 --sweep --kinds bf16,w4g128,w4_words,bf16_stack \
    --weights 4096x4096,4096x11008,11008x4096,4096x14336 --no-attention --write-table "$out/dispatch_words.json"
# FP8 W8A8 (E4M3, new since the H200 run): the Pallas kernel and XLA's FP8 dot against bf16, and PyTorch's
# _scaled_mm beside them, on one weight shape (issue #15's target: >= 1.6x bf16).
# Since the CPU's SASS check (scripts/kernel_sass.py): the FP8 kernel on FP8 wgmma (fp8_dot), and the int8
# kinds K-major (*_nk: the layout for_decode gives a decode loop on a GPU; W8A8 also at prefill rows, where the
# w8a8/fp8 kinds transpose the weight per call).
step fp8 100 "$py" scripts/bench_kernels.py --reps 10 --kinds bf16,fp8,w8a8,w8,fp8_nk,w8a8_nk,w8_nk \
    --weights 4096x11008 --no-attention --write-table "$out/dispatch_fp8.json"
# bf16 decode of Llama-2-7B shapes ran at 90 tok/s scanned on an H200 (a third of the weights' bandwidth):
# unrolled vs scanned on 4 layers says whether the scan's weight slicing costs it (docs/kernels.md).
# Quantized kernels read their layer in place inside the scan since (llmeq_jax/layer_slice.py); bf16's XLA dot
# may still copy its slice: the second run asks XLA for dynamic-slice fusion.
# The GEMV formulation of the weight-only kernel (new, pallas_kernels/gemv.py) against the dot kernel's
# options at decode rows; with unmasked tile loads where blocks divide the shapes (also new).
step gemv 80 "$py" scripts/tune_weight_only.py --shapes 4096x11008 --rows 1 4 --bits 4 8 --budget-s 60 \
    --out "$out/gemv.jsonl"
# Weight-only prefill (0.27-0.29x bf16 in the kernel, 0.68-0.96x by XLA's path on the H200): dequant="scaled"
# (new: scales folded into the weight tile, 256-row tiles; half the instructions per FLOP in SASS).
step prefill 80 "$py" scripts/tune_weight_only.py --shapes 4096x11008 --rows 2048 --bits 4 --budget-s 60 \
    --out "$out/prefill.jsonl"
step layout 110 "$py" scripts/bench_e2e.py --shapes "$shapes" --layers 4 --dtype bfloat16 --recipes rtn-w4-g128 \
    --batches 1 --prefill-len 512 --new-tokens 32 --repeats 2 --scan-layers --no-torch --out "$out/layout.json"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" step layout_dsf 60 "$py" scripts/bench_e2e.py \
    --shapes "$shapes" --layers 4 --dtype bfloat16 --recipes bf16 --batches 1 --prefill-len 512 --new-tokens 32 \
    --repeats 2 --scan-layers --no-torch --out "$out/layout_dsf.json"
# bf16 scanned again with the words step's table active. On a GPU the decode step's stacked bf16 kernels go to
# float_matmul (in place) unless a table measured XLA's slice-and-dot faster: where the words step did, this row
# is XLA's path (compare with layout's bf16+scan row, float_matmul, and its unrolled bf16 row, no slices at all).
# layout_dsf's flag only changes XLA's path, which bf16 scanned now takes only where such a table says so.
LLMEQ_DISPATCH_TABLE="$out/dispatch_words.json" step layout_float 60 "$py" scripts/bench_e2e.py --shapes "$shapes" \
    --layers 4 --dtype bfloat16 --recipes bf16 --batches 1 --prefill-len 512 --new-tokens 32 --repeats 2 \
    --scan-layers --no-torch --out "$out/layout_float.json"
step e2e 230 "$py" scripts/bench_e2e.py --shapes "$shapes" "${layers[@]}" --dtype bfloat16 --recipes rtn-w4-g128 rtn-w8 fp8-w8a8 \
    --batches 1 16 --prefill-len 2048 --new-tokens 32 --repeats 2 --scan-only --out "$out/e2e.json"
step kernels 90 "$py" scripts/bench_kernels.py --reps 10 --kinds bf16,w8a8,fp8,w8,w4g128,w8a8_nk,fp8_nk,w8_nk \
    --write-table "$out/dispatch.json"
echo "== [$(( SECONDS - start ))s] done; results in $out"
