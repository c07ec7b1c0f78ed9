// Native CPU kernels for quantized matmuls, called from JAX through the XLA FFI.
//
// Two products (see llmeq_jax/native.py for the Python side and the exact
// layouts it passes):
//
//   llmeq_wo_matmul    y[M,N] = x[M,K] (f32) @ dequant(W)      weight-only
//   llmeq_w8a8_matmul  y[M,N] = (xq[M,K] (s8) @ W (s8)) * scales  W8A8
// and the row-major decode kernels, a decode attention, packed float panels and a float
// decode GEMV (each introduced where it is defined).
//
// One translation unit: this file includes the parts below, in this order, inside one anonymous
// namespace, so the compiler sees every kernel's helpers and inlines across parts (a later part
// uses what an earlier one defines); it then binds the FFI handlers.
//
//   cpu_features.inc       which SIMD paths this CPU runs (AVX2+FMA, AVX-512 VNNI, AMX), and their off switches
//   threads.inc            work split over XLA's intra-op pool (parallel_for) and the decode kernels' SpinPool
//   amx.inc                AMX-INT8 tiles (where the CPU has them): their configuration and operands
//   weight_only.inc        llmeq_wo_matmul: x @ dequant(W), W column-major or row-major, int8 / int4 codes
//   w8a8.inc               llmeq_w8a8_matmul: int8 x int8 GEMMs (AVX2 panels, AVX-512 VNNI, AMX)
//   row_major.inc          decode: few rows against (N, K) weights (int16 / int8 activations), portable + AVX2
//   row_major_vnni.inc     the same on AVX-512 VNNI, and the split rows' tile (int2-int6 codes in 2-6 bits)
//   row_major_run.inc      a row-major product's run: chunks over the threads, the activations quantized
//   matmul_ffi.inc         the FFI handlers of the three products above
//   float_gemv.inc         llmeq_float_gemv: float32 / bfloat16 decode products, a layer of a stack in place
//   decode_attention.inc   llmeq_decode_attention: a few query positions over a float KV cache
//   prefill_attention.inc  the same for many positions, blocked, exp on AVX2 / AVX-512
//   float_panels.inc       llmeq_panel_matmul: float GEMMs on kernels packed once into 32-column panels
//   int_panels.inc         weight-only products of many rows on integer panels (AVX-512 VNNI, AMX)
//   attention_blocks.inc   AVX-512 decode attention, 16 cache slots a step
//   kv_store.inc           the quantized KV store: attention over its codes, appending a step
//
// Weight-only numerics: per contraction group g and output n,
//   y[m,n] = sum_g scale[g,n] * (sum_{k in g} x[m,k] q[k,n] - zp[g,n] * sum_{k in g} x[m,k])
// which is the XLA reference (x @ (q - zp)) * scale up to float summation order.
//
// W8A8 numerics: the integer part sum_{k in g} xq[m,k] q[k,n] is exact int32
// (int16 x int16 -> int32 pair products, vpmaddwd), then exactly as the XLA
// reference: y = (sum_g (float(acc) - xsum * zp) * scale) * sx[m].
//
// Every AVX2 function is compiled with a target attribute and called only when
// the CPU reports AVX2 + FMA at run time, so the library builds and loads on
// any x86-64 (or non-x86) machine and falls back to the scalar loops.
//
// Threads: work is split into chunks claimed from an atomic counter by the
// calling thread and by tasks scheduled on XLA's intra-op pool. The caller only
// ever waits for chunks somebody already claimed, so it can never deadlock on a
// pool that is busy (or has no threads): it then simply does all the work.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
#define LLMEQ_X86 1
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define LLMEQ_X86 0
#endif

namespace ffi = xla::ffi;

namespace {

#include "cpu_features.inc"
#include "threads.inc"
#include "amx.inc"
#include "weight_only.inc"
#include "w8a8.inc"
#include "row_major.inc"
#include "row_major_vnni.inc"
#include "row_major_run.inc"
#include "matmul_ffi.inc"
#include "float_gemv.inc"
#include "decode_attention.inc"
#include "prefill_attention.inc"
#include "float_panels.inc"
#include "int_panels.inc"
#include "attention_blocks.inc"
#include "kv_store.inc"

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(llmeq_wo_matmul, wo_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layout")
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("has_zp")
                                  .Attr<int64_t>("swiglu")
                                  .Attr<int64_t>("int_panels"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(llmeq_w8a8_matmul, w8_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("has_zp"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(llmeq_rm_a16, rm_a16_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("has_zp")
                                  .Attr<int64_t>("step_groups")
                                  .Attr<int64_t>("split"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(llmeq_rm_a8, rm_a8_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("has_zp"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(llmeq_panel_matmul, panel_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("swiglu"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(llmeq_float_gemv, fg_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(llmeq_decode_attention, at_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("masked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(llmeq_kv_store_attention, kvs_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("masked")
                                  .Attr<int64_t>("rope")
                                  .Attr<int64_t>("extra"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(llmeq_kv_store_append, kva_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("bits"));

// Plain C helpers for Python (ctypes): what the library was built for and what this CPU runs.
extern "C" {
__attribute__((visibility("default"))) int llmeq_native_simd() { return use_avx2() ? 1 : 0; }
__attribute__((visibility("default"))) void llmeq_native_force_scalar(int on) { g_allow_simd.store(on ? 0 : 1); }
__attribute__((visibility("default"))) int llmeq_native_vnni() { return use_vnni() ? 1 : 0; }
__attribute__((visibility("default"))) int llmeq_native_avx512() { return use_avx512() ? 1 : 0; }
__attribute__((visibility("default"))) void llmeq_native_allow_vnni(int on) { g_allow_vnni.store(on ? 1 : 0); }
__attribute__((visibility("default"))) int llmeq_native_amx() { return use_amx() ? 1 : 0; }
__attribute__((visibility("default"))) void llmeq_native_allow_amx(int on) { g_allow_amx.store(on ? 1 : 0); }
__attribute__((visibility("default"))) int64_t llmeq_native_amx_blocks() { return g_amx_blocks.load(); }
__attribute__((visibility("default"))) int llmeq_native_abi_version() { return 18; }
}
