#!/usr/bin/env bash
# Prepared runs for a lent GPU machine (issue #15): the kernels' gpu test cases, kernel-level timings that write
# dispatch-table entries, and end-to-end decode / prefill of published shapes with random weights against our bf16.
# Each step has its own time limit and writes its log (and any table it measures) under $OUT (default runs/gpu), so
# a slow step cannot eat the others' time. The device tool carries the working tree; run from its root (the machine
# reaches no registry). Every GPU session's record, and which kernel has run on hardware, is in docs/kernels.md
# ("Status at a glance" first).
#
# Budget, as measured so far: a session has 15 minutes of device time, a call at most 10; a start takes ~40 s to a
# few minutes; the machine stays warm ~30 s after a call, and ignored paths (runs/tables: the tables and gpu-test
# verdicts of the calls so far) survive between calls only while it is warm. Compiling dominates: ~25 Mosaic gpu
# cases need ~150 s on four processes; an e2e variant of a 32-layer model ~60-100 s (weights, quantizing, the
# decode and prefill programs).
#
# The next GPU session, first call (every kernel written since the last hardware run has its gpu cases here, and
# gpu_tests adds those of the checked kernels changed since their runs: 90 cases where TESTS alone selects 64; the
# tables the call measures are merged over the shipped one before e2e runs; xla_subchannel's 5 cases passing turn a
# prompt's int4 products to XLA's sub-channel fusion, llmeq_jax/subchannel.py, for e2e's prefill column):
#     STEPS="gpu_tests decode_hopper e2e" TESTS_LIMIT=140 \
#         TESTS="hopper or store or float_decode or rms_norm or norm_fold or split_fixup or prompt_attention or int8_f16
#         or token_codes or xla_subchannel" \
#         RECIPES="rtn-w4-g128 rtn-w8" TORCH=--no-torch E2E_LIMIT=200 bash scripts/gpu_session.sh   (timeout_s 600,
#     carry ["runs/wheels"]: pytest-xdist's wheels, made here with
#     pip download --no-deps pytest-xdist==3.8.0 execnet==2.1.2 -d runs/wheels)
# (e2e's rows carry each variant's logits against XLA alone on the same weights: read them before the speeds), then
# at once, on the machine still warm: STEPS="attention prefill_subchannel" (timeout_s 440). Next (W8A8's decode
# layers are 10 launches with token_codes and the gate in the kernel, FP8's never run end to end): STEPS="e2e"
# RECIPES="rtn-w8a8 fp8-w8a8" TORCH=--no-torch E2E_LIMIT=280 (timeout_s 330). A later session: STEPS="decode_fold
# decode_fold_bf16" (timeout_s 360: the norms folded against apart, end to end), STEPS="decode_fixup
# decode_fixup_bf16" (timeout_s 420: split sums and RoPE in the kernels against XLA's), STEPS="decode_hopper_w8a8 hopper
# hopper_fp8 hopper_w8"; the read-ahead of pallas_kernels/prefetch.py in two calls, STEPS="prefetch
# decode_prefetch" (timeout_s 420) and STEPS="decode_prefetch_bf16 decode_concurrent" (timeout_s 300); then the
# steps docs/kernels.md lists as never run.
# A measured table joins the shipped ones with
#     python -m llmeq_jax.dispatch_table merge runs/gpu/dispatch_X.json --over-shipped --into \
#         llmeq_jax/dispatch_tables/<DEVICE>.json
# and a kernel whose gpu cases all passed joins (or renews) the checked ones, back on the CPU at the commit that ran:
#     python -m pallas_kernels.fingerprints --run "H100, <date>" KERNEL   (pallas_kernels/hardware_fingerprints.json)
#
# Knobs (environment): STEPS (a subset of the step names below; default all), OUT, PYTHON, SHAPES / LAYERS (other
# published shapes, fewer layers), RECIPES / BATCHES / TORCH (--no-torch: no transformers rows) for e2e, E2E_LIMIT /
# E2E_KV_LIMIT / SWEEP_LIMIT / TESTS_LIMIT (seconds), TESTS (a pytest -k expression) and TESTS_WORKERS for gpu_tests,
# DECODE_WEIGHTS for decode_hopper, KV_BITS for e2e_kv.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu}"
py="${PYTHON:-$(command -v python || command -v python3)}"  # the interpreter with jax (CUDA), torch, transformers
shapes="${SHAPES:-llama-2-7b}"            # SHAPES / LAYERS: other published shapes or fewer layers (a quick check)
layers=(${LAYERS:+--layers "$LAYERS"})
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
all_steps="gpu_tests words sweep attention fp8 w8a8_sweep probe small small_e2e e2e e2e_kv"
all_steps+=" decode_sweep decode_sweep_w8 decode_sweep_bf16 norms float_attention graphs_off graphs_on graphs_7b"
all_steps+=" gemv prefill prefill_words hopper hopper_fp8 hopper_w8 decode_hopper decode_hopper_sweep layout"
all_steps+=" layout_dsf decode_hopper_w8a8"
all_steps+=" prompt_attention prefetch decode_prefetch decode_prefetch_bf16 decode_concurrent decode_fold"
all_steps+=" decode_fold_bf16 decode_fixup decode_fixup_bf16 prefill_subchannel"
steps="${STEPS:-$all_steps layout_float kernels}"  # STEPS: a subset
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, its output in $out/NAME.log
  local name=$1 limit=$2
  shift 2
  [[ " $steps " == *" $name "* ]] || return 0
  echo "== [$(( SECONDS - start ))s] $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "   exit $? ; tail:"
  tail -n 25 "$out/$name.log"
  # the tables measured so far, kept on this machine for a later call's e2e step (ignored paths survive between
  # calls while the machine is warm; a call stopped by its limit has kept those of its finished steps)
  mkdir -p runs/tables && cp "$out"/dispatch_*.json runs/tables/ 2>/dev/null
  [[ $name == gpu_tests ]] && cat "$out/gpu_tests.log" >> runs/tables/gpu_tests.log  # every call's verdicts
  return 0
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/device.txt" 2>&1
"$py" -c "import jax; print(jax.__version__, jax.devices())" >> "$out/device.txt" 2>&1
cat "$out/device.txt"
# -v: each case's verdict as it finishes (a run stopped by its limit keeps them); TESTS: a -k expression.
# The cases run in TESTS_WORKERS processes at once (pytest-xdist; 4 by default, 0: one process): a case's time is
# almost all compiling on the host's CPUs (16 cores), so one process left the GPU idle and ~25 Mosaic cases took
# more than 150 s. Each process takes GPU memory as it needs it (no preallocation: four would ask 75 % each).
# The GPU machine reaches no registry and may lack pytest-xdist: its pure-Python wheels travel with the call
# (here: pip download --no-deps pytest-xdist==3.8.0 execnet==2.1.2 -d runs/wheels; the device tool's carry:
# runs/wheels), unpacked onto PYTHONPATH (their dist-info's entry point registers -n). Without them: one process.
workers="${TESTS_WORKERS:-4}"
if [[ $workers != 0 ]] && ! "$py" -c "import xdist" 2> /dev/null; then
  for wheel in runs/wheels/*.whl; do
    [[ -f $wheel ]] && "$py" -m zipfile -e "$wheel" runs/pylib
  done
  export PYTHONPATH="$PWD/runs/pylib:$PYTHONPATH"
  "$py" -c "import xdist" 2> /dev/null || { echo "   no pytest-xdist (carry runs/wheels): the gpu cases in one process"; workers=0; }
fi
gpu_test_workers=(-n "$workers" --dist load)
[[ $workers == 0 ]] && gpu_test_workers=()
# LLMEQ_UNCHECKED_KERNELS=all: the cases reach every kernel, those not yet run on a GPU included (a GPU's default
# trace leaves them out: pallas_kernels/hardware_checked.py). The cases of checked kernels changed since their run
# (pallas_kernels/hardware_fingerprints.json's "unrun") join TESTS' by themselves.
tests="${TESTS:-float_decode or int8 or words or store or quantized_cache}"
unrun=$("$py" -m pallas_kernels.hardware_checked --unrun-cases)
[[ -n "$unrun" ]] && tests="($tests) or $unrun"
LLMEQ_UNCHECKED_KERNELS=all XLA_PYTHON_CLIENT_PREALLOCATE=false step gpu_tests "${TESTS_LIMIT:-90}" \
    "$py" -m pytest -v --tb=line -p no:cacheprovider "${gpu_test_workers[@]}" -m gpu \
    tests/pallas_kernels/test_gpu_kernels.py -k "$tests"
failed_case() {  # failed_case NAME: whether a gpu case whose id holds NAME failed in this call's gpu_tests
  # (a verdict line reads "... prompt_attention8 FAILED" from one process, "FAILED ...prompt_attention8" from xdist's)
  # (runs/tables keeps every call's verdicts on a machine still warm, beside its tables)
  grep -Eqs "$1.* FAILED|FAILED .*$1" "$out/gpu_tests.log" runs/tables/gpu_tests.log
}
# The kernels not yet run on a GPU (pallas_kernels/hardware_checked.py; e.g. the norm and float-cache attention
# kernels, cuDNN's prompt attention) join the steps after where their gpu cases passed in this session and none
# failed: the e2e rows then time them. One whose cases failed keeps XLA's path.
if [[ -z "${LLMEQ_UNCHECKED_KERNELS:-}" ]]; then  # (one given to the script is kept)
  LLMEQ_UNCHECKED_KERNELS=$("$py" -m pallas_kernels.hardware_checked "$out/gpu_tests.log" runs/tables/gpu_tests.log)
  export LLMEQ_UNCHECKED_KERNELS
fi
echo "   kernels not yet checked on a GPU, on for the steps after: ${LLMEQ_UNCHECKED_KERNELS:-none}"
# int4 decode as words of eight K values (pallas_kernels.int4_words: 1.2-1.8x bf16 at M = 1 on the last H200 run;
# since, its scale rows are read one K step ahead, which the SASS showed as a synchronous load every step), on the
# four shapes of issue #15's int4 target (>= 2.5x bf16 at M <= 16), beside the int8 K-major kernel (w8_nk, rtn-w8's
# decode kernel) and XLA's path; the table entries go to the shipped table (python -m llmeq_jax.dispatch_table
# merge). The dot kernel (w4g128, 0.8-1.04x) and bf16_stack (float_matmul in place, 0.9-1.04x) ran on the last H200
# run and are in the shipped table: left out to leave the limit to the new kinds.
# --sweep: the word kernel's other tiles, warps, stages and split counts at M = 1 on every shape.
# w4_xla_rows (new): the same int4 weights as XLA's int4 type, K-major, in one multiply-reduce (one XLA row
# reduction, deviceless compile) -- whether XLA's own fusion streams int4 faster than the Pallas kernels.
# w4_gemv: the int4 GEMV (no tensor cores, many small programs; never timed) beside the word kernel at M = 1:
# whether the words are bound by instructions or by latency their few warps leave unhidden.
# w4_xla_words (new): the word kernel's own words unpacked by XLA in one multiply-and-sum (one column reduction).
# w4_xla_groups (new): int4 (K, N) as jnp.int4, one batched dot per scale group (at M = 16 one XLA GEMM fusion).
# w8_nk_f16 (new): the K-major int8 weights with float16 operands (pallas_kernels/int8_f16.py, 2.2 instructions
# per weight in SASS against w8_nk's 4.5; rtn-w8's decode kernel if it wins).
step words 110 "$py" scripts/bench_kernels.py --reps 10 --rows 1,16 \
    --kinds bf16,w4_words,w4_xla_rows,w4_xla_words,w4_xla_groups,w4_gemv,w8_nk,w8_nk_f16 \
    --weights 4096x4096,4096x11008,11008x4096,4096x14336 --no-attention --write-table "$out/dispatch_words.json"
# The settings of the word kernel (tiles, warps, stages, splits; K blocks of 256 / 512: two / four word blocks
# an iteration; epilogue="mma": the scale / zero-point rows through dots, no layout conversions) and of the
# int8 float16 kernel (tiles, splits) at M = 1, each timed in turns with bf16 and its defaults.
step sweep 120 "$py" scripts/bench_kernels.py --reps 10 --sweep --rows 1 --kinds bf16,w4_words,w8_nk_f16 \
    --weights 4096x4096,4096x11008 --no-attention
# KV decode attention at 32K (int8 / int4 codes against bf16 XLA attention; issue #15: >= 1.5x / 2x) and its
# sweep: split counts, 3-4 cp.async stages (at 2 the compiled loop waits for every copy at its top), 8 warps over
# 128-256-token blocks (22 barriers per 256 tokens against 32; sm_90 SASS, no spills). New: XLA's own GEMM fusions
# over the int8 / int4 codes (llmeq_jax/kv/store_attention.py) beside the kernel, at 32K and (defaults only) 4K
# tokens; dispatch_kv.json's kv_attention entries say which a decode step takes (merge them into the shipped table).
# Since 2026-12-06 also the Mosaic GPU int8 kernel (pallas_kernels/kv_attention_hopper.py: the codes converted into
# shared memory, flash decoding on wgmma; kv_attention_hopper entries against the faster of the other two) and its
# split counts; and over pre-RoPE keys (the cache's default spec) the Triton kernel and the Mosaic kernel, both
# rotating each key by its slot's position (kv_attention_hopper_rope entries, against the Triton kernel).
step attention 160 "$py" scripts/bench_kernels.py --reps 10 --sweep --rows 1 --kinds bf16 --weights 4096x4096 \
    --write-table "$out/dispatch_kv.json"
# FP8 W8A8 (E4M3, new since the H200 run): the Pallas kernel and XLA's FP8 dot against bf16, and PyTorch's
# _scaled_mm beside them, on one weight shape (issue #15's target: >= 1.6x bf16).
# Since the CPU's SASS check (scripts/kernel_sass.py): the FP8 kernel on FP8 wgmma (fp8_dot), and the int8
# kinds K-major (*_nk: the layout for_decode gives a decode loop on a GPU; W8A8 also at prefill rows, where the
# w8a8/fp8 kinds transpose the weight per call).
step fp8 80 "$py" scripts/bench_kernels.py --reps 10 --kinds bf16,fp8,w8a8,w8,fp8_nk,w8a8_nk,w8_nk \
    --weights 4096x11008 --no-attention --write-table "$out/dispatch_fp8.json"
# W8A8 prefill, K-major (1.04-1.10x bf16 at M = 512-2048 on the H200 on 2026-11-28, with blocks tuned for the (K, N)
# kernel on an H100; issue #15: >= 1.5x at M >= 1024): other tiles, warps and stages at M = 2048 (since 2026-12-05
# also smaller ones that fit four programs an SM: Triton waits for every int8 wgmma, docs/kernels.md).
step w8a8_sweep 80 "$py" scripts/bench_kernels.py --reps 10 --sweep --rows 2048 --kinds bf16,w8a8_nk \
    --weights 4096x11008 --no-attention
# Where the word kernel's time goes (scripts/probe_words.py, new): its launch with the loop reduced to the loads,
# then + the nibbles' dequantization and MMAs, then + the offset's sums, beside the kernel and the bf16 dot, and the
# loads under other splits, stages, warps and widths -- whether the loop's work or the launch bounds int4 decode.
step probe 75 "$py" scripts/probe_words.py --reps 10 --weights 4096x4096,4096x11008
# Whether the bus, idle while a decode layer's small kernels run, can bring the next product's int4 weights into L2
# (scripts/probe_prefetch.py, new): a stacked layer loop of norms then the word kernel, with each layer's first 8 or
# 16 MB of words read beside the norms, on the main stream and on a second one, under XLA's default command-buffer
# order and under CONCURRENT; gate/up and down after 2 norms, then q/k/v after 6 (the ~6 kernels between a layer's
# down projection and the next q/k/v). ~42 compiles.
step prefetch 200 bash -c "\"$py\" scripts/probe_prefetch.py --reps 10 --window 2 --weights 4096x22016,11008x4096 \
    --mb 8,16; \"$py\" scripts/probe_prefetch.py --reps 10 --window 6 --weights 4096x12288 --mb 8,16"
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
# Prompts over the int4 decode words (pallas_kernels/int4_words_prefill.py, new: the transposed product, the
# dequantized weights as wgmma's A operand from registers, one dot a word block) against bf16 and XLA's path of the
# packed weights (what prompts take today: 0.88-0.96x bf16 at 2048-4096 rows on the H200) on #15's four int4 shapes
# at 512-4096 rows, its block settings swept on 4096x11008 -> dispatch_prefill_words.json (int4_words_prefill).
step prefill_words 200 "$py" scripts/bench_kernels.py --reps 10 --sweep --rows 512,2048,4096 \
    --kinds bf16,w4_words_prefill --weights 4096x4096,4096x11008,11008x4096,4096x14336 --no-attention \
    --write-table "$out/dispatch_prefill_words.json"
# XLA's own GEMM with an int4 g128 dequantization fused in (compiled with
# xla_gpu_experimental_enable_subchannel_dequantisation_fusion) against bf16 and XLA's usual path of the packed QArray
# (printed beside w4g128's rows; 0.88-0.96x bf16 on the H200; #15 wants 0.95x) on the four int4 shapes at 512-4096
# rows: w4_xla_subchannel (jnp.int4 codes stored so), w4_xla_subchannel_packed (a prompt's path,
# llmeq_jax.subchannel, from the QArray's packed bytes) and w4_xla_subchannel_zp (the same with rtn-w4-g128's zero
# points: two more rows a group) -> dispatch_subchannel.json (xla_subchannel, xla_subchannel_zp); and at 1 and 16
# rows w4_xla_subchannel beside the word kernel (w4_words): whether codes stored as jnp.int4 would serve decode too.
step prefill_subchannel 240 "$py" scripts/bench_kernels.py --reps 10 --rows 1,16,512,2048,4096 \
    --kinds bf16,w4g128,w4_words,w4_xla_subchannel,w4_xla_subchannel_packed,w4_xla_subchannel_zp --no-attention \
    --weights 4096x4096,4096x11008,11008x4096,4096x14336 \
    --write-table "$out/dispatch_subchannel.json"
# The Mosaic GPU W8A8 kernel (pallas_kernels/w8a8_hopper.py: int8 wgmma kept in flight, which Triton never does with
# int32 accumulators) against bf16 and the Triton kernel over the same K-major weights (w8a8_nk: what a prompt's
# W8A8 product takes today, 1.04-1.27x bf16 at 2048 rows on the H200; #15 wants 1.5x at M >= 1024) on the four
# shapes at 512-4096 rows, its settings swept on 4096x11008 -> dispatch_hopper.json (w8a8_hopper).
step hopper 200 "$py" scripts/bench_kernels.py --reps 10 --sweep --rows 512,2048,4096 \
    --kinds bf16,w8a8_nk,w8a8_hopper --weights 4096x4096,4096x11008,11008x4096,4096x14336 --no-attention \
    --write-table "$out/dispatch_hopper.json"
# The same Mosaic GPU kernel with FP8 (E4M3) wgmma (w8a8_hopper(fp8=True): each 128-value K step's sums promoted into
# float32, 64 x 128 tiles a warpgroup) against bf16, the Triton FP8 kernel over the same K-major weights (fp8_nk: what
# a prompt's fp8-w8a8 product takes today, 0.75-0.90x bf16 at 512-2048 rows on the H200) and torch's _scaled_mm
# (1.53-1.88x its bf16 there; #15 wants 1.6x) -> dispatch_hopper_fp8.json (fp8_w8a8_hopper), settings swept on
# 4096x11008.
step hopper_fp8 150 "$py" scripts/bench_kernels.py --reps 10 --sweep --rows 512,2048 \
    --kinds bf16,fp8_nk,fp8_hopper --weights 4096x4096,4096x11008,11008x4096,4096x14336 --no-attention \
    --write-table "$out/dispatch_hopper_fp8.json"
# The Mosaic GPU weight-only kernel for prompts (pallas_kernels/weight_only_hopper.py: each tile of int8 codes or
# int4 pairs dequantized into shared memory, then bf16 wgmma) against bf16 and XLA's path of the same weights (what
# a prompt's rtn-w8 / rtn-w4-g128 product takes today: 0.78-0.90x / 0.47-0.75x bf16 end to end on the H200; #15
# wants 0.95x at M >= 256) on the four shapes at 512 and 2048 rows, its settings swept on 4096x11008 ->
# dispatch_hopper_w8.json (weight_only_hopper, 8 and 4 bits).
step hopper_w8 200 "$py" scripts/bench_kernels.py --reps 10 --sweep --rows 512,2048 \
    --kinds bf16,w8_hopper,w4_hopper --weights 4096x4096,4096x11008,11008x4096,4096x14336 --no-attention \
    --write-table "$out/dispatch_hopper_w8.json"
# The Mosaic GPU decode kernel (pallas_kernels/decode_hopper.py: one program per SM streaming (N, K) int4 or int8
# rows by TMA through a ring, dequantized in registers as wgmma's A operand) at decode rows against bf16, the Triton
# kernels it would replace (int4 words; K-major int8 with float16 operands) and XLA's path on Llama-2-7B's decode
# products (fused q/k/v 4096x12288, o, fused gate/up 4096x22016, down) and Llama-3-8B's MLP ->
# dispatch_decode_hopper.json (decode_hopper, 4 and 8 bits, against the faster of those: e2e's rtn-w4-g128 and
# rtn-w8 decode then run it where it won); then its step size, ring depth and K splits in turns with bf16 at M = 1.
# DECODE_WEIGHTS: Llama-2-7B's four decode products by default (Llama-3-8B's MLP, 4096x14336, follows them by
# inference where they agree; add it for a Llama-3-8B e2e run).
step decode_hopper 240 "$py" scripts/bench_kernels.py --reps 10 --rows 1,16 \
    --kinds bf16,w4_words,w4_decode_hopper,w8_nk_f16,w8_decode_hopper \
    --weights "${DECODE_WEIGHTS:-4096x4096,4096x12288,4096x22016,11008x4096}" --no-attention \
    --write-table "$out/dispatch_decode_hopper.json"
# The same kernel's W8A8 mode (decode_hopper.w8a8_decode_hopper: x's int8 / E4M3 codes against the weights' straight
# from shared memory, no dequantization; rtn-w8a8's and fp8-w8a8's decode products) against bf16, the K-major Triton
# W8A8 kernels it would replace (w8a8_nk 1.20-1.29x, fp8_nk 1.03-1.21x bf16 at M <= 16 on the H200) and XLA's path ->
# dispatch_decode_w8a8.json (w8a8_decode_hopper / fp8_w8a8_decode_hopper).
step decode_hopper_w8a8 150 "$py" scripts/bench_kernels.py --reps 10 --rows 1,16 \
    --kinds bf16,w8a8_nk,w8a8_decode_hopper,fp8_nk,fp8_decode_hopper \
    --weights 4096x4096,4096x12288,4096x22016,11008x4096 --no-attention \
    --write-table "$out/dispatch_decode_w8a8.json"
step decode_hopper_sweep 120 "$py" scripts/bench_kernels.py --reps 10 --sweep --rows 1 \
    --kinds bf16,w4_decode_hopper,w8_decode_hopper --weights 4096x4096,11008x4096 --no-attention
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
# ~100 s a variant at 32 layers last time (quantizing, and compiling the decode loop and the prompt's prefill twice:
# now once, generate.decode_timing): bf16, transformers bf16 with a static cache, then the recipes (RECIPES;
# rtn-w4-g128 first: rtn-w8 ran end to end on 2026-12-04, rtn-w4-g128 did not finish since 2026-11-27). BATCHES:
# decode batch sizes (16 adds a compile a variant). A run cut by its limit keeps the rows it finished and its log
# the phases of the variant it stopped in (bench_e2e's progress lines). --profile: where each
# of our variants' decode step goes, per GPU kernel (one decode traced after the timings; the Pallas matmuls,
# norms, RoPE, attention, cache updates, split-K sums) against the step's wall time.
# Tables this machine measured in an earlier call (kept under runs/tables: ignored paths survive between calls
# while the machine is warm), merged over the shipped table, so that e2e decodes with the choices a user of this
# GPU would get once they ship; none here: the shipped table as it is.
# (--over-shipped: where no table ships for this GPU, e.g. an H100, the one of its architecture, the H200's)
# A table measured here of a kernel whose gpu cases failed here is left out: dispatch would send products to it.
declare -A TABLE_KERNELS=([dispatch_decode_hopper.json]=decode_hopper [dispatch_decode_w8a8.json]=decode_hopper
    [dispatch_kv.json]=kv_attention_hopper [dispatch_hopper.json]=w8a8_hopper [dispatch_hopper_fp8.json]=fp8_hopper
    [dispatch_hopper_w8.json]=weight_only_hopper [dispatch_prefill_words.json]=int4_words_prefill)
merge_tables() {  # LLMEQ_DISPATCH_TABLE = the shipped table with those measured so far on this machine merged over it
  local tables=() table kernel merged="$out/merged_table.json"
  for table in runs/tables/dispatch_*.json; do
    [[ -e "$table" ]] || continue
    kernel=${TABLE_KERNELS[$(basename "$table")]:-}
    if [[ -n "$kernel" ]] && failed_case "$kernel"; then
      echo "   $table left out: a $kernel gpu case failed"
      continue
    fi
    tables+=("$table")
  done
  (( ${#tables[@]} )) || return 0
  rm -f "$merged"
  "$py" -m llmeq_jax.dispatch_table merge "${tables[@]}" --over-shipped --into "$merged" \
      && export LLMEQ_DISPATCH_TABLE="$merged"
}
# A small model's products (SmolLM2-135M: q/k/v fused 576x960, o 576x576, gate/up fused 576x3072, down 1536x576;
# K = 576 is not a multiple of the 128-value groups), which the shipped table never measured: on 2026-12-04 its
# quantized decode ran at 0.34-0.50x bf16 with the kernels the static rule gave it. Each kind against XLA's path
# and bf16, and the word kernel's sweep (narrower tiles, a split per K step) -> their table entries; then its
# decode end to end with them merged over the shipped table (--profile: each kernel's µs).
step small 110 "$py" scripts/bench_kernels.py --reps 10 --sweep --rows 1,16 \
    --kinds bf16,w4_words,w4g128,w8,w8_nk,w8_nk_f16,bf16_stack --weights 576x960,576x576,576x3072,1536x576 \
    --no-attention --write-table "$out/dispatch_small.json"
[[ " $steps " == *" small_e2e "* ]] && merge_tables
step small_e2e 90 "$py" scripts/bench_e2e.py --shapes smollm2-135m --dtype bfloat16 --recipes rtn-w8 rtn-w4-g128 \
    --batches 1 --prefill-len 2048 --new-tokens 32 --repeats 2 --scan-only --no-torch --profile \
    --out "$out/small_e2e.json"
[[ " $steps " == *" e2e "* ]] && merge_tables
step e2e "${E2E_LIMIT:-340}" "$py" scripts/bench_e2e.py --shapes "$shapes" "${layers[@]}" --dtype bfloat16 \
    --recipes ${RECIPES:-rtn-w4-g128 rtn-w8} --batches ${BATCHES:-1} --prefill-len 2048 --new-tokens 32 --repeats 2 \
    --scan-only ${TORCH:---torch} --profile --out "$out/e2e.json"
# A quantized KV cache end to end (2026-12-05: its decode step's write one kernel, the float sinks in the store
# kernel's softmax; 35-51 -> 20 launches a layer, deviceless): bf16 and rtn-w4-g128 after a 4096-token prompt,
# each row's decode over an int8 cache (online key ranges) beside its own float cache's.
step e2e_kv "${E2E_KV_LIMIT:-240}" "$py" scripts/bench_e2e.py --shapes "$shapes" "${layers[@]}" --dtype bfloat16 \
    --recipes rtn-w4-g128 --batches 1 --prompt-len 4096 --prefill-len 512 --new-tokens 32 --repeats 2 --scan-only \
    --no-torch --kv-bits "${KV_BITS:-8}" --out "$out/e2e_kv.json"
# Kernel launch settings timed end to end (scripts/sweep_decode.py, new): the quantized model's decode under its
# kernels' defaults and under each setting (split targets, tiles, K steps, stages, warps; the word kernel's mma
# epilogue) in turns, beside bf16, two rounds, one process -- where timing the kernels alone could not tell the
# settings apart (their run-to-run spread was as large). ~35 s of weights, then ~6 s a setting (its compile).
step decode_sweep "${SWEEP_LIMIT:-200}" "$py" scripts/sweep_decode.py --shapes "$shapes" "${layers[@]}" \
    --recipe rtn-w4-g128 --out "$out/sweep_w4.json"
step decode_sweep_w8 "${SWEEP_LIMIT:-150}" "$py" scripts/sweep_decode.py --shapes "$shapes" "${layers[@]}" \
    --recipe rtn-w8 --out "$out/sweep_w8.json"
step decode_sweep_bf16 90 "$py" scripts/sweep_decode.py --shapes "$shapes" "${layers[@]}" --recipe bf16 \
    --out "$out/sweep_bf16.json"
# Each decode product's weights read ahead into L2 while the small kernels before it run (pallas_kernels/prefetch.py,
# new; off by default): whole decodes under the read-ahead's sizes and streams, rtn-w4-g128 then bf16 (the baseline
# gets the same chance). Its one-product probe is the prefetch step (scripts/probe_prefetch.py).
step decode_prefetch 200 "$py" scripts/sweep_decode.py --shapes "$shapes" "${layers[@]}" --recipe rtn-w4-g128 \
    --settings prefetch:mb=4 prefetch:mb=12 prefetch:mb=4,stream=side prefetch:mb=12,stream=side \
    prefetch:mb=24,stream=side --out "$out/sweep_prefetch_w4.json"
step decode_prefetch_bf16 120 "$py" scripts/sweep_decode.py --shapes "$shapes" "${layers[@]}" --recipe bf16 \
    --settings prefetch:mb=12 prefetch:mb=12,stream=side prefetch:mb=24,stream=side \
    --out "$out/sweep_prefetch_bf16.json"
# The same under XLA's CONCURRENT command-buffer order (kernels ordered by their data alone, where the default
# follows the latency-hiding scheduler's order): the main stream's read-ahead may only overlap the window there, and
# independent small kernels (a cache's writes, split-K sums) may overlap each other for every variant. Its bf16 and
# defaults rows against decode_prefetch's say what the mode does by itself.
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_command_buffer_scheduling_mode=CONCURRENT" step decode_concurrent 150 \
    "$py" scripts/sweep_decode.py --shapes "$shapes" "${layers[@]}" --recipe rtn-w4-g128 --settings prefetch:mb=4 \
    prefetch:mb=12 --out "$out/sweep_concurrent_w4.json"
# A decode step's norms folded into the products after them (pallas_kernels/norm_fold.py, new: no launch for either
# norm of a layer; the word kernel's loop 570 -> 735 instructions a K step, sm_90 SASS): whole decodes with the norms
# folded (the defaults, where norm_fold's gpu cases passed) and apart, rtn-w4-g128 then bf16 (the baseline folds too).
fold_on="${LLMEQ_UNCHECKED_KERNELS:-}"
failed_case norm_fold || fold_on="${fold_on:+$fold_on,}norm_fold"  # a failed case keeps the norms apart
LLMEQ_UNCHECKED_KERNELS="$fold_on" step decode_fold 200 "$py" scripts/sweep_decode.py --shapes "$shapes" \
    "${layers[@]}" --recipe rtn-w4-g128 --settings int4_words:norm=apart --out "$out/sweep_fold_w4.json"
LLMEQ_UNCHECKED_KERNELS="$fold_on" step decode_fold_bf16 120 "$py" scripts/sweep_decode.py --shapes "$shapes" \
    "${layers[@]}" --recipe bf16 --settings float_matmul:norm=apart --out "$out/sweep_fold_bf16.json"
# A split product's partial sums added by its own kernel's last program of each tile, with the bias and the residual
# (pallas_kernels/split_fixup.py, new: with the SwiGLU gate and the attention's merge, 11 -> 7 launches a rtn-w4-g128
# layer, 14 -> 11 bf16, deviceless H100): whole decodes with the fix-up (the default, where split_fixup's gpu cases
# passed) and with XLA's sums (the products', the attention's), rtn-w4-g128 then bf16.
fixup_on="${LLMEQ_UNCHECKED_KERNELS:-}"
failed_case split_fixup || fixup_on="${fixup_on:+$fixup_on,}split_fixup"  # a failed case keeps XLA's sums
LLMEQ_UNCHECKED_KERNELS="$fixup_on" step decode_fixup 260 "$py" scripts/sweep_decode.py --shapes "$shapes" \
    "${layers[@]}" --recipe rtn-w4-g128 --settings int4_words:reduce=xla append_decode_attention:reduce=xla \
    append_decode_attention:rope=xla --out "$out/sweep_fixup_w4.json"
LLMEQ_UNCHECKED_KERNELS="$fixup_on" step decode_fixup_bf16 120 "$py" scripts/sweep_decode.py --shapes "$shapes" \
    "${layers[@]}" --recipe bf16 --settings float_matmul:reduce=xla --out "$out/sweep_fixup_bf16.json"
# Loops as CUDA graphs: XLA records each layer's kernels as a command buffer, but a while loop only when asked
# (+WHILE; its defaults: FUSION CUBLAS CUBLASLT CUDNN CUSTOM_CALL CONDITIONAL DYNAMIC_SLICE_FUSION), so the host
# launches every layer of every token. Until 2026-12-04 the scan's index array made a dynamic-slice thunk per layer
# that kept the layer loop out of any graph ("WhileThunk is not convertible to command buffers because its body
# contains loop-dependent DynamicSliceFusionV2Thunk"); the index now rides in the carry. SmolLM2's decode (host-bound
# if any is) with and without +WHILE, then Llama-2-7B rtn-w4-g128 with it (the e2e step's rows are without).
step graphs_off 60 "$py" scripts/bench_e2e.py --shapes smollm2-135m --dtype bfloat16 --recipes rtn-w8 rtn-w4-g128 \
    --batches 1 --prefill-len 512 --new-tokens 64 --repeats 3 --scan-only --no-torch --out "$out/graphs_off.json"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE" step graphs_on 60 "$py" scripts/bench_e2e.py \
    --shapes smollm2-135m --dtype bfloat16 --recipes rtn-w8 rtn-w4-g128 --batches 1 --prefill-len 512 \
    --new-tokens 64 --repeats 3 --scan-only --no-torch --out "$out/graphs_on.json"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE" step graphs_7b 150 "$py" scripts/bench_e2e.py \
    --shapes "$shapes" "${layers[@]}" --dtype bfloat16 --recipes rtn-w4-g128 --batches 1 --prefill-len 512 \
    --new-tokens 64 --repeats 3 --scan-only --no-torch --out "$out/graphs_7b.json"
# The decode RMSNorm kernel (pallas_kernels/rms_norm.py, new: one launch where XLA makes two at batch 1, on by
# default on a GPU for bf16 and int4 blocks) against XLA's norm, chained 8 deep, at the three models' widths:
# dispatch_norms.json's rms_norm entries turn it off where XLA's was faster (merge into the shipped table).
step norms 40 "$py" scripts/bench_kernels.py --reps 20 --norms 576,4096 --rows 1,16 --write-table \
    "$out/dispatch_norms.json"
# A decode step's attention over a bf16 cache (pallas_kernels/decode_attention.py, new: the token's key and value
# written and the slots up to it attended in one launch, where XLA's path is six a layer) against XLA's update and
# attention, Llama-2-7B's and Llama-3-8B's heads at 256 / 4K / 32K slots, steps carried in place over a stacked
# cache; dispatch_float_kv.json's 16-bit kv_attention entries send a length back to XLA where it was faster.
step float_attention 60 "$py" scripts/bench_kernels.py --reps 5 --float-attention --write-table \
    "$out/dispatch_float_kv.json"
# A prompt's attention as cuDNN's flash attention (kv.attention.attention_flash, new: on a GPU from 128 positions,
# where XLA writes the whole float32 score matrix) against XLA's, Llama-2-7B's and Llama-3-8B's heads at 128-4096
# positions; dispatch_prompt.json's prompt_attention entries send a length back to XLA where it was faster.
step prompt_attention 60 "$py" scripts/bench_kernels.py --reps 10 --prompt-attention --rows 128,512,2048,4096 \
    --write-table "$out/dispatch_prompt.json"
step kernels 90 "$py" scripts/bench_kernels.py --reps 10 --kinds bf16,w8a8,fp8,w8,w4g128,w8a8_nk,fp8_nk,w8_nk \
    --write-table "$out/dispatch.json"
echo "== [$(( SECONDS - start ))s] done; results in $out"
