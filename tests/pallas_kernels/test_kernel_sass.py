"""scripts/kernel_sass.py: reading SASS, and every case lowering to the Triton kernels it compiles."""

import importlib.util
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("kernel_sass", Path(__file__).parents[2] / "scripts/kernel_sass.py")
kernel_sass = sys.modules.setdefault("kernel_sass", importlib.util.module_from_spec(SPEC))  # dataclasses look it up
SPEC.loader.exec_module(kernel_sass)

# cuobjdump -sass lines: a prologue, a loop from 0x0040 back-branching at 0x00c0, an epilogue
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                      /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;                /* 0x0000000404027981 */
        /*0020*/                   STL [R1], R2 ;                              /* 0x0000000201007387 */
        /*0040*/                   LDS.U8 R6, [R3] ;                           /* 0x0000000003067984 */
        /*0050*/              @!PT LDS.U8 RZ, [RZ] ;                           /* 0x00000000fffff984 */
        /*0060*/                   I2F.BF16 R7, R6 ;                           /* 0x0000000600077306 */
        /*0070*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;      /* 0x000000100c08723c */
        /*0080*/                   LDL R9, [R1] ;                              /* 0x0000000001097983 */
        /*0090*/                   SHFL.BFLY PT, R10, R9, 0x1, 0x1f ;          /* 0x0c201f0009007f89 */
        /*00a0*/                   FFMA R11, R10, R9, R11 ;                    /* 0x000000090a0b7223 */
        /*00b0*/                   ISETP.GE.AND P0, PT, R3, 0x10, PT ;         /* 0x000000100300780c */
        /*00c0*/               @P0 BRA 0x40 ;                                  /* 0xffffff7000000947 */
        /*00d0*/                   STG.E desc[UR4][R4.64], R11 ;               /* 0x0000000b04007986 */
        /*00e0*/                   EXIT ;                                      /* 0x000000000000794d */
        /*00f0*/                   BRA 0xf0;                                   /* 0xfffffffc00fc7947 */
"""


def test_summarize_reads_the_hottest_loop():
    s = kernel_sass.summarize(SASS)
    assert s["loop"] == 9 and not s["unrolled"]  # 0x40 .. 0xc0; the self-branch at 0xf0 is not a loop body
    assert s["tensor_core"] == {"HMMA.16816.F32.BF16": 1}
    assert (s["conversions"], s["shared_bytes"], s["spills"], s["shuffles"], s["float"]) == (1, 2, 1, 1, 1)
    assert dict(s["top"])["LDS.U8"] == 2  # the predicated one counts under its opcode


def test_summarize_takes_a_loopless_kernel_whole():
    body = "\n".join(line for line in SASS.splitlines() if "BRA" not in line)
    s = kernel_sass.summarize(body)
    assert s["loop"] == 13 and s["unrolled"]


def test_resources_parses_cuobjdump_usage():
    usage = " Function w8a8_matmul:\n  REG:177 STACK:0 SHARED:1024 LOCAL:16 CONSTANT[0]:584 TEXTURE:0"
    assert kernel_sass.resources(usage) == {"regs": 177, "local": 16}


@pytest.mark.parametrize("name", ["wo_int4_m1", "wo_int4_m16_words", "gemv_int4_m1", "w8a8_fp8_m4096", "kv_int4_32k",
                                  "kv_append_int4"])
def test_cases_lower_to_the_kernels_they_name(name):
    fn, args = kernel_sass.CASES[name].build()
    kernels = kernel_sass.triton_modules(fn, *args)
    # the KV store's decode kernels merge their splits in a second one
    assert [k.name for k in kernels[1:]] == (["merge_splits"] if name.startswith("kv_int") else [])
    assert "tt.func" in kernels[0].ttir and kernels[0].num_warps >= 1
    assert all(g >= 1 for g in kernels[0].grid)
