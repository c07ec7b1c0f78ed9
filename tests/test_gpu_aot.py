"""scripts/gpu_aot.py: reading XLA's dumps of a deviceless GPU compile (the compile itself needs JAX's CUDA
plugin, which the test venv does not hold: see the script's docstring)."""

import importlib.util
import re
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("gpu_aot", Path(__file__).parents[1] / "scripts/gpu_aot.py")
gpu_aot = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_aot)

# A thunk sequence as XLA dumps it: a loop over tokens holding the loop over layers.
THUNKS = """\
001: kCustomKernel [source | next=002 (1)] input_reduce_fusion_9 grid: [1, 1, 1] threads: [2, 1, 1]  shared_memory: 0 bytes
002: kWhile        [prev=001 (1) | next=020 (1)]
condition:
    003: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    004: kCopy         [source       | next=005 (1)] kCopy
    005: kWhile        [prev=004 (1) | next=019 (1)]
condition:
        006: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        007: kAsyncStart   [source        | next=010 (3)] stream=computation_stream[0], async_id=7
            009: kDynamicSliceFusion [source | sink] params=1, results=1
                008: kCopy [source | sink] kCopy
        010: kCustomKernel [prev=008 (1)  | next=011 (1)] int4_words_matmul grid: [1, 48, 6] threads: [128, 1, 1]  shared_memory: 41984 bytes
        011: kCustomKernel [prev=010 (1)  | next=012 (1)] gemm_fusion_dot_23 grid: [2048, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
        012: kCustomKernel [prev=011 (1)  | next=013 (1)] loop_reduce_fusion grid: [96, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
        013: kCustomKernel [prev=012 (1)  | sink        ] int4_words_matmul grid: [1, 48, 6] threads: [128, 1, 1]  shared_memory: 41984 bytes
    019: kCustomKernel [prev=005 (1) | sink] loop_add_fusion_4 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
020: kCustomKernel [prev=002 (1) | sink] wrapped_add grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""

# Optimized HLO: the outer body holds a while; the inner (layer) body copies two weights out of their stack
# in one fusion, and a small s32 slice (below the size listed).
HLO = """\
%fused_dynamic_slice (p0: bf16[4,512,1024], p1: s32[]) -> (bf16[1,512,1024], bf16[1,512,1024]) {
  %dynamic-slice.1 = bf16[1,512,1024]{2,1,0} dynamic-slice(%p0, %p1), dynamic_slice_sizes={1,512,1024}
  ROOT %tuple = (bf16[1,512,1024]{2,1,0}, bf16[1,512,1024]{2,1,0}) tuple(%dynamic-slice.1, %dynamic-slice.1)
}

%body.2 (param: (s32[], bf16[4,512,1024])) -> (s32[], bf16[4,512,1024]) {
  %gte = bf16[4,512,1024]{2,1,0} get-tuple-element(%param), index=1
  %loop_dynamic_slice_fusion = (bf16[1,512,1024]{2,1,0}, bf16[1,512,1024]{2,1,0}) fusion(%gte, %i), kind=kLoop, calls=%fused_dynamic_slice
  %small = s32[1]{0} dynamic-slice(%idx, %i), dynamic_slice_sizes={1}
  %copy.3 = f32[1024,1024]{1,0} copy(%x)
  ROOT %t = (s32[], bf16[4,512,1024]) tuple(%i, %gte)
}

%body.1 (param: (s32[], bf16[4,512,1024])) -> (s32[], bf16[4,512,1024]) {
  %copy.9 = f32[4096,1024]{1,0} copy(%y)
  %w = (s32[], bf16[4,512,1024]) while(%param), condition=%cond.2, body=%body.2
  ROOT %t = (s32[], bf16[4,512,1024]) tuple(%i, %gte)
}

ENTRY %main (a: bf16[4,512,1024]) -> bf16[4,512,1024] {
  %copy.1 = bf16[4,512,1024]{2,1,0} copy(%a)
  %w = (s32[], bf16[4,512,1024]) while(%t), condition=%cond.1, body=%body.1
}
"""


def test_shape_bytes_sums_a_tuple_and_reads_every_dtype():
    assert gpu_aot.shape_bytes("bf16[1,512,1024]{2,1,0}") == 2 * 512 * 1024
    assert gpu_aot.shape_bytes("(bf16[2,3]{1,0}, s8[10]{0}, f32[])") == 12 + 10 + 4
    assert gpu_aot.shape_bytes("f8e4m3fn[16,16]") == 256


def test_launches_of_the_innermost_loop_body():
    body = gpu_aot.innermost_loop_body(THUNKS)
    assert body[0].startswith("007: kAsyncStart") and body[-1].startswith("013:")  # not the outer body's 019
    seen = gpu_aot.launches(body)
    assert seen["pallas"] == ["int4_words_matmul [1, 48, 6]"] * 2
    assert (seen["gemm"], seen["fusion"], seen["copy"]) == (1, 1, 1)


def test_cudnns_attention_counts_as_a_kernel():
    """A prompt's flash attention is a cuDNN thunk (kCuDnn): listed beside the Pallas kernels, not dropped."""
    body = ["050: kCuDnn        [prev=049 (1)  | next=052 (2) ] kCuDnn",
            "051: kCustomKernel [prev=050 (1) | sink] gemm_fusion_dot_3 grid: [8, 1, 1] threads: [128, 1, 1]"]
    seen = gpu_aot.launches(body)
    assert seen["pallas"] == ["cuDNN"] and seen["gemm"] == 1


def test_mosaic_gpus_custom_calls_count_as_kernels():
    """A Mosaic GPU kernel (pallas_kernels.w8a8_hopper) is an FFI custom call thunk with no name: listed as one."""
    body = ["037: kCustomCall   [prev=036 (1) | next=039 (2) ] kCustomCall",
            "051: kCustomKernel [prev=050 (1) | sink] loop_add_fusion grid: [8, 1, 1] threads: [128, 1, 1]"]
    seen = gpu_aot.launches(body)
    assert seen["pallas"] == ["custom call"] and seen["fusion"] == 1


def test_of_two_innermost_loops_the_layers_longer_one():
    """A tied LM head over a quantized table runs a loop over row chunks beside the layers' loop, as deep: the
    layers' (longer) body is the one counted."""
    head = """\
    021: kWhile        [prev=019 (1) | next=000 (1)]
condition:
        022: kCustomKernel [source | sink] loop_compare_fusion_2 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        023: kCustomKernel [source | next=024 (1)] input_reduce_fusion grid: [64, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
        024: kCustomKernel [prev=023 (1) | sink] loop_add_fusion_3 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""
    lines = THUNKS.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("    019:")) + 1
    body = gpu_aot.innermost_loop_body("".join(lines[:at]) + head + "".join(lines[at:]))
    assert body[0].startswith("007: kAsyncStart") and len(gpu_aot.launches(body)["pallas"]) == 2


def test_fusion_writes_of_the_innermost_loop_split_gemms_from_the_rest():
    """What the layer loop's GEMM fusions write, and what its other fusions write (a multi-output fusion's every
    result; int4 at half a byte, as XLA packs it), the outer loop's and the entry's not counted."""
    body = ('  %gemm_fusion_dot.3 = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.3_computation\n'
            '  %loop_convert_fusion.2 = (s4[64,32]{1,0:E(4)}, f32[8]{0}) fusion(%q), kind=kLoop, calls=%fused_convert\n'
            '  ROOT %input_concatenate_fusion = bf16[4,130]{1,0} fusion(%x), kind=kInput, calls=%fused_concatenate\n')
    hlo = HLO.replace("  %small = ", body + "  %small = ")
    assert gpu_aot.fusion_writes(hlo) == (64 * 32 * 2, 2 * (512 * 1024 * 2) + 64 * 32 // 2 + 8 * 4 + 4 * 130 * 2)
    assert gpu_aot.shape_bytes("s4[4096,32,130]{2,1,0:E(4)}") == 4096 * 32 * 130 // 2


def test_big_copies_of_the_innermost_loop_only():
    """The layer loop's dynamic-slice fusion and its large copy are listed, with bytes; the small slice, the
    outer loop's copy and the entry's copy are not."""
    copies = dict(gpu_aot.big_copies(HLO))
    assert copies == {"loop_dynamic_slice_fusion": 2 * (512 * 1024 * 2), "copy.3": 4 << 20}


def test_big_copies_counts_an_asynchronous_slice_by_its_result():
    """XLA 0.11 runs a layer's slice of a stacked weight as an ``async-start`` of a dynamic-slice fusion on another
    stream (a bf16 prompt's weights): listed with the slice's bytes, not the stack's its tuple also names; an
    asynchronous start of something else is not a copy."""
    body = (
        '  %fusion-start.4 = ((bf16[2,4096,4096]{2,1,0}, s32[]), bf16[1,4096,4096]{2,1,0}, u32[]) '
        'async-start(%a, %i), calls=%async_computation.4, metadata={scheduling_name="fusion-start.4"}\n'
        '  %all-gather-start = ((bf16[1024,1024]{1,0}), bf16[4096,1024]{1,0}, u32[]) '
        'async-start(%b), calls=%async_computation.5, metadata={op_name="x/all_gather"}\n'
        '  %copy-start.2 = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, u32[]) copy-start(%x)\n')
    called = """\
%async_computation.4 (p0: bf16[2,4096,4096], p1: s32[]) -> bf16[1,4096,4096] {
  ROOT %loop_dynamic_slice_fusion.17 = bf16[1,4096,4096]{2,1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_dynamic_slice
}

%async_computation.5 (p0: bf16[1024,1024]) -> bf16[4096,1024] {
  ROOT %all-gather = bf16[4096,1024]{1,0} all-gather(%p0), dimensions={0}
}

"""
    hlo = called + HLO.replace("  %small = ", body + "  %small = ")
    copies = dict(gpu_aot.big_copies(hlo))
    assert copies["fusion-start.4"] == 4096 * 4096 * 2 and copies["copy-start.2"] == 4 << 20
    assert "all-gather-start" not in copies
    assert gpu_aot.tuple_elements("((bf16[2,3]{1,0}, s32[]), bf16[1,3]{1,0}, u32[])") == \
        ["(bf16[2,3]{1,0}, s32[])", "bf16[1,3]{1,0}", "u32[]"]


def test_read_dump_finds_the_named_module(tmp_path):
    """The decode loop's dump by default, the prefill's (--prefill) by its module name; a missing one is named."""
    for module in ("jit__decode_loop", "jit_prefill"):
        (tmp_path / f"module_0001.{module}.sm_9.0a_gpu_after_optimizations.txt").write_text(f"hlo {module}")
        (tmp_path / f"module_0001.{module}.thunk_sequence.txt").write_text(f"thunks {module}")
    assert gpu_aot.read_dump(tmp_path) == ("hlo jit__decode_loop", "thunks jit__decode_loop")
    assert gpu_aot.read_dump(tmp_path, "jit_prefill") == ("hlo jit_prefill", "thunks jit_prefill")
    with pytest.raises(SystemExit, match="no \\*jit_other\\*gpu_after_optimizations.txt"):
        gpu_aot.read_dump(tmp_path, "jit_other")


def test_the_kv_flags_make_the_cache_they_name():
    """--kv-static / --kv-sinks / --kv-post-rope: the quantized cache's setting compiled (online ranges from the
    prompt by default, as a cache without a calibration pass; calibrated ones with placeholder ranges)."""
    from types import SimpleNamespace

    config = SimpleNamespace(num_layers=2, num_kv_heads=4, head_dim=8)
    online = gpu_aot.kv_quantizer(SimpleNamespace(kv_bits=8, kv_static=False, kv_sinks=4, kv_post_rope=False), config)
    assert online.key_ranges is None and online.spec.online_keys and online.spec.sink_tokens == 4
    assert online.spec.pre_rope and online.spec.bits == 8
    static = gpu_aot.kv_quantizer(SimpleNamespace(kv_bits=4, kv_static=True, kv_sinks=0, kv_post_rope=True), config)
    assert not static.spec.online_keys and static.spec.needs_key_ranges and static.spec.sink_tokens == 0
    assert static.key_ranges.lo.shape == (2, 4, 8) and not static.spec.pre_rope and static.spec.bits == 4


def test_ptx_for_ptxas_lowers_only_a_newer_isa_version():
    """Mosaic GPU's PTX says ISA 9.0; the setup's ptxas reads up to 8.8: only the version line changes, and only
    when newer."""
    mosaic = "//\n.version 9.0\n.target sm_90a\n.address_size 64\n// .version 9.0 in a comment stays\n"
    assert gpu_aot.ptx_for_ptxas(mosaic) == mosaic.replace(".version 9.0\n.target", ".version 8.8\n.target")
    triton = ".version 8.7\n.target sm_90a\n"
    assert gpu_aot.ptx_for_ptxas(triton) == triton
    assert gpu_aot.ptx_for_ptxas(".version 8.10\n") == ".version 8.8\n"  # numbers, not strings, compared


def test_each_target_describes_its_gpu():
    """The GpuTargetConfig of each target: its device kind (what dispatch tables are keyed by), compute capability
    and the shared memory a block may opt into, which is what a kernel sized for Hopper can overflow elsewhere."""
    expected = {"h100": ("NVIDIA H100 80GB HBM3", 9, 0, 232448), "h200": ("NVIDIA H200", 9, 0, 232448),
                "a100": ("NVIDIA A100-SXM4-80GB", 8, 0, 166912), "l40": ("NVIDIA L40", 8, 9, 101376)}
    assert set(gpu_aot.TARGETS) == set(expected)
    for name, (kind, major, minor, smem) in expected.items():
        text = gpu_aot.target_config(name)
        assert f'device_description_str: "{kind}"' in text
        assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in text
        assert f"shared_memory_per_block_optin: {smem} " in text
        assert not re.search(r"\{[a-z_]+\}", text)  # every field filled in


def test_launch_settings_put_every_given_setting_in_force_for_the_block():
    """--settings: each ``kernel:fields`` parsed and overridden while the loop is traced, none after; a typo fails
    before anything compiles."""
    from pallas_kernels import settings

    with gpu_aot.launch_settings(["int4_words:bn=256,stages=4", "int8_f16:convert=xla"]):
        assert settings.of("int4_words", 1) == settings.Settings(bn=256, stages=4)
        assert settings.of("int8_f16", 1) == settings.Settings(convert="xla")
    assert settings.current() == ()
    with pytest.raises(ValueError, match="unknown field"), gpu_aot.launch_settings(["int4_words:tile=3"]):
        pass
