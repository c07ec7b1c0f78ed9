// Native CPU kernels for quantized matmuls, called from JAX through the XLA FFI.
//
// Two products (see llmeq_jax/native.py for the Python side and the exact
// layouts it passes):
//
//   llmeq_wo_matmul    y[M,N] = x[M,K] (f32) @ dequant(W)      weight-only
//   llmeq_w8a8_matmul  y[M,N] = (xq[M,K] (s8) @ W (s8)) * scales  W8A8
// and the row-major decode kernels, a decode attention, packed float panels and a float
// decode GEMV (each introduced where it is defined below).
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
#include <immintrin.h>
#else
#define LLMEQ_X86 0
#endif

namespace ffi = xla::ffi;

namespace {

// ----------------------------------------------------------------------------- CPU features

bool cpu_has_avx2_fma() {
#if LLMEQ_X86 && (defined(__GNUC__) || defined(__clang__))
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// AVX-512 VNNI (vpdpbusd: 64 u8 x s8 products summed into 16 int32 per instruction, 4x the
// MACs of a float FMA of the same width). libgcc's check includes the OS's zmm state.
bool cpu_has_avx512_vnni() {
#if LLMEQ_X86 && (defined(__GNUC__) || defined(__clang__))
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni") && cpu_has_avx2_fma();
  return ok;
#else
  return false;
#endif
}

// Set to 0 by llmeq_native_force_scalar() so tests can check the portable path here too.
std::atomic<int> g_allow_simd{1};

bool use_avx2() { return g_allow_simd.load(std::memory_order_relaxed) && cpu_has_avx2_fma(); }
// Set to 0 by llmeq_native_allow_vnni(0) so tests can check the AVX2 code on an AVX-512 CPU too.
std::atomic<int> g_allow_vnni{1};
bool use_vnni() { return use_avx2() && g_allow_vnni.load(std::memory_order_relaxed) && cpu_has_avx512_vnni(); }
// The AVX-512 float tiles of the prefill attention: on the same switch (every AVX-512 VNNI CPU has AVX-512F).
bool use_avx512() { return use_vnni(); }

// ----------------------------------------------------------------------------- threading

// Pool tasks per call at most: LLMEQ_NATIVE_THREADS - 1 (the caller is a thread too).
int64_t max_workers() {
  static const int64_t cap = [] {
    const char* env = std::getenv("LLMEQ_NATIVE_THREADS");
    return env && std::atoi(env) > 0 ? int64_t(std::atoi(env)) - 1 : int64_t(1) << 30;
  }();
  return cap;
}

// Runs body(i) for i in [0, n). Worker tasks share the state through a
// shared_ptr: a task that starts after the call returned finds no chunk left
// and never touches `body` (which lives on the caller's stack).
void parallel_for(ffi::ThreadPool* pool, int64_t n, const std::function<void(int64_t)>& body) {
  int64_t workers = pool ? std::min<int64_t>({pool->num_threads(), n - 1, max_workers()}) : 0;
  if (workers <= 0) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0;
    const std::function<void(int64_t)>* body = nullptr;
  };
  auto st = std::make_shared<State>();
  st->n = n;
  st->body = &body;
  auto run = [st]() {
    int64_t i;
    while ((i = st->next.fetch_add(1, std::memory_order_relaxed)) < st->n) {
      (*st->body)(i);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t w = 0; w < workers; ++w) pool->Schedule([run]() { run(); });
  run();
  // Everything left is being computed right now by a worker: a short wait.
  int spins = 0;
  while (st->done.load(std::memory_order_acquire) < n) {
    if (++spins < 2000) {
#if LLMEQ_X86
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Packed float kernels (llmeq_panel_matmul): columns per panel, rows per AVX-512 tile, and
// activation bytes per row block.
constexpr int64_t kPanelCols = 32;
constexpr int64_t kPanelTileRows = 12;
constexpr int64_t kPanelBlockBytes = 1 << 20;
// Weight-only products of more rows than this run on dequantized panels where AVX-512 runs.
constexpr int64_t kWoPanelMinRows = 8;

// Row blocks of a panel product: at least two (one per thread), each at most ~kPanelBlockBytes
// of activations, and no more than there are 12-row tiles.
inline int64_t panel_row_blocks(int64_t M, int64_t K) {
  return std::min(cdiv(M, kPanelTileRows), std::max<int64_t>(2, cdiv(M * K * 4, kPanelBlockBytes)));
}

// ----------------------------------------------------------------------------- weight-only

// One weight-only product. kn: q is (K or K/2 packed, N), scale/zp are (G, N).
// nk: q is (N, K or K/2 packed), scale/zp are (N, G).
struct WO {
  const float* x;      // [M, K]
  const uint8_t* q;    // int8 values, or two 4-bit values per byte (low nibble = even k)
  const float* scale;  // see above
  const float* zp;     // same shape as scale, or nullptr (symmetric)
  float* y;            // [M, N]
  int64_t M, K, N, gs, G;
  bool int4;
  bool nk;
  bool swiglu;         // kn only: W is a joined gate/up kernel (gate first), y = silu(x @ gate) * (x @ up), N / 2 columns
  int int_bits;        // past kWoPanelMinRows on AVX-512 VNNI: the integer panels with int16 (16) or int8 (8) x,
                       // else (0) the float ones
  int64_t Kb;          // stored length of the K axis: K (int8) or ceil(K/2) (int4)
  // Prepared on the calling thread:
  const float* xsum;   // [M, G] sums of x per group (only with zp)
  const float* xl;     // int4: [M, Kb] x[2j] * 2^-28
  const float* xh;     // int4: [M, Kb] x[2j+1] * 2^-4
};

inline int sext4(int v) { return (v & 8) ? (v | ~15) : (v & 15); }

inline float wo_weight(const WO& p, int64_t k, int64_t n) {
  int64_t idx = p.nk ? n * p.Kb + (p.int4 ? k / 2 : k) : (p.int4 ? k / 2 : k) * p.N + n;
  if (!p.int4) return static_cast<float>(static_cast<int8_t>(p.q[idx]));
  int b = p.q[idx];
  return static_cast<float>((k & 1) ? sext4(b >> 4) : sext4(b & 15));
}

inline int64_t sidx(const WO& p, int64_t g, int64_t n) { return p.nk ? n * p.G + g : g * p.N + n; }

// Portable reference loops for an (m, n) rectangle; also the column / row tails of the SIMD paths.
void wo_scalar(const WO& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = p.x + m * p.K;
    for (int64_t n = n0; n < n1; ++n) {
      float tot = 0.f;
      for (int64_t g = 0; g < p.G; ++g) {
        int64_t k0 = g * p.gs, k1 = std::min(p.K, k0 + p.gs);
        float acc = 0.f;
        for (int64_t k = k0; k < k1; ++k) acc += xr[k] * wo_weight(p, k, n);
        if (p.zp) acc -= p.zp[sidx(p, g, n)] * p.xsum[m * p.G + g];
        tot += p.scale[sidx(p, g, n)] * acc;
      }
      p.y[m * p.N + n] = tot;
    }
  }
}

// Few-row kn products stream the kernel (wo_kn_stream): at most these rows, and columns per chunk.
constexpr int64_t kStreamMaxRows = 8;
constexpr int64_t kStreamMaxCols = 512;

#if LLMEQ_X86
#define AVX2 __attribute__((target("avx2,fma")))

// Low nibble of each sign-extended byte, times 2^28; high nibble times 2^4. Both exact in
// float; x was pre-scaled by 2^-28 / 2^-4, so the products are exactly x * w.
AVX2 inline void int4_decode(__m128i bytes8, __m256& lo, __m256& hi) {
  __m256i b = _mm256_cvtepi8_epi32(bytes8);
  lo = _mm256_cvtepi32_ps(_mm256_slli_epi32(b, 28));
  hi = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(~15)));
}

AVX2 inline __m256 int8_decode(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// kn: MT activation rows x (8 * NV) output columns starting at (m0, c0), all groups.
// The kernel rows are streamed once per call; the group sums live in registers and
// are scaled into y at each group end.
template <int MT, int NV>
AVX2 void wo_kn_block(const WO& p, int64_t m0, int64_t c0) {
  for (int64_t g = 0; g < p.G; ++g) {
    int64_t k0 = g * p.gs, k1 = std::min(p.K, k0 + p.gs);
    __m256 a[MT][NV];
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < NV; ++v) a[m][v] = _mm256_setzero_ps();
    if (!p.int4) {
      for (int64_t k = k0; k < k1; ++k) {
        const uint8_t* row = p.q + k * p.N + c0;
        __m256 xb[MT];
        for (int m = 0; m < MT; ++m) xb[m] = _mm256_broadcast_ss(p.x + (m0 + m) * p.K + k);
        for (int v = 0; v < NV; ++v) {
          __m256 w = int8_decode(row + 8 * v);
          for (int m = 0; m < MT; ++m) a[m][v] = _mm256_fmadd_ps(xb[m], w, a[m][v]);
        }
      }
    } else {
      for (int64_t j = k0 / 2, j1 = cdiv(k1, 2); j < j1; ++j) {
        const uint8_t* row = p.q + j * p.N + c0;
        __m256 xl[MT], xh[MT];
        for (int m = 0; m < MT; ++m) {
          xl[m] = _mm256_broadcast_ss(p.xl + (m0 + m) * p.Kb + j);
          xh[m] = _mm256_broadcast_ss(p.xh + (m0 + m) * p.Kb + j);
        }
        for (int v = 0; v < NV; ++v) {
          __m256 lo, hi;
          int4_decode(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * v)), lo, hi);
          for (int m = 0; m < MT; ++m) {
            a[m][v] = _mm256_fmadd_ps(xl[m], lo, a[m][v]);
            a[m][v] = _mm256_fmadd_ps(xh[m], hi, a[m][v]);
          }
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      __m256 s = _mm256_loadu_ps(p.scale + g * p.N + c0 + 8 * v);
      __m256 z = p.zp ? _mm256_loadu_ps(p.zp + g * p.N + c0 + 8 * v) : _mm256_setzero_ps();
      for (int m = 0; m < MT; ++m) {
        __m256 t = a[m][v];
        if (p.zp) t = _mm256_fnmadd_ps(z, _mm256_broadcast_ss(p.xsum + (m0 + m) * p.G + g), t);
        float* yp = p.y + (m0 + m) * p.N + c0 + 8 * v;
        __m256 prev = g == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(yp);
        _mm256_storeu_ps(yp, _mm256_fmadd_ps(t, s, prev));
      }
    }
  }
}

// All M rows for columns [c0, c1) (c1 - c0 <= 64): m tiles of 4/2/1, column blocks of
// 64/32/16/8, scalar for the last N % 8 columns.
template <int MT>
AVX2 void wo_kn_cols_mt(const WO& p, int64_t m0, int64_t c0, int64_t c1) {
  constexpr int NV = MT == 1 ? 8 : (MT == 2 ? 4 : 2);
  int64_t c = c0;
  for (; c + 8 * NV <= c1; c += 8 * NV) wo_kn_block<MT, NV>(p, m0, c);
  for (; c + 8 <= c1; c += 8) wo_kn_block<MT, 1>(p, m0, c);
  if (c < c1) wo_scalar(p, m0, m0 + MT, c, c1);
}

AVX2 void wo_kn_cols(const WO& p, int64_t c0, int64_t c1) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) wo_kn_cols_mt<4>(p, m, c0, c1);
  for (; m + 2 <= p.M; m += 2) wo_kn_cols_mt<2>(p, m, c0, c1);
  for (; m < p.M; ++m) wo_kn_cols_mt<1>(p, m, c0, c1);
}

// kn, few activation rows: stream the kernel row by row across columns [c0, c1).
// Four kernel rows (int8) or two packed rows (int4, four k) are read side by side and
// folded into one pass over a per-group accumulator that stays in L1, so memory sees a
// few long sequential streams (the column-blocked wo_kn_block touches one 64-byte line
// per row, a strided pattern the prefetchers served at a fraction of the bandwidth).
AVX2 void wo_kn_stream(const WO& p, int64_t c0, int64_t c1) {
  const int64_t W = c1 - c0, V = W / 8;  // whole vectors; the W % 8 tail is scalar
  const int64_t S = cdiv(W, 8) * 8;      // accumulator row stride: keeps every row 32-byte aligned
  alignas(32) float acc[kStreamMaxRows * kStreamMaxCols];
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t k0 = g * p.gs, k1 = std::min(p.K, k0 + p.gs);
    std::fill(acc, acc + p.M * S, 0.f);
    if (!p.int4) {
      int64_t k = k0;
      for (; k + 4 <= k1; k += 4) {
        const uint8_t* r = p.q + k * p.N + c0;
        for (int64_t v = 0; v < V; ++v) {
          __m256 w0 = int8_decode(r + 8 * v), w1 = int8_decode(r + p.N + 8 * v);
          __m256 w2 = int8_decode(r + 2 * p.N + 8 * v), w3 = int8_decode(r + 3 * p.N + 8 * v);
          for (int64_t m = 0; m < p.M; ++m) {
            const float* xm = p.x + m * p.K + k;
            __m256 a = _mm256_load_ps(acc + m * S + 8 * v);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xm), w0, a);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 1), w1, a);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 2), w2, a);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 3), w3, a);
            _mm256_store_ps(acc + m * S + 8 * v, a);
          }
        }
      }
      for (; k < k1; ++k) {
        const uint8_t* r = p.q + k * p.N + c0;
        for (int64_t v = 0; v < V; ++v) {
          __m256 w0 = int8_decode(r + 8 * v);
          for (int64_t m = 0; m < p.M; ++m) {
            __m256 a = _mm256_load_ps(acc + m * S + 8 * v);
            _mm256_store_ps(acc + m * S + 8 * v, _mm256_fmadd_ps(_mm256_broadcast_ss(p.x + m * p.K + k), w0, a));
          }
        }
      }
    } else {
      int64_t j = k0 / 2;
      const int64_t j1 = cdiv(k1, 2);
      for (; j + 2 <= j1; j += 2) {
        const uint8_t* r = p.q + j * p.N + c0;
        for (int64_t v = 0; v < V; ++v) {
          __m256 lo0, hi0, lo1, hi1;
          int4_decode(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 8 * v)), lo0, hi0);
          int4_decode(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + p.N + 8 * v)), lo1, hi1);
          for (int64_t m = 0; m < p.M; ++m) {
            const float* xl = p.xl + m * p.Kb + j;
            const float* xh = p.xh + m * p.Kb + j;
            __m256 a = _mm256_load_ps(acc + m * S + 8 * v);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xl), lo0, a);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xh), hi0, a);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xl + 1), lo1, a);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xh + 1), hi1, a);
            _mm256_store_ps(acc + m * S + 8 * v, a);
          }
        }
      }
      for (; j < j1; ++j) {
        const uint8_t* r = p.q + j * p.N + c0;
        for (int64_t v = 0; v < V; ++v) {
          __m256 lo, hi;
          int4_decode(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 8 * v)), lo, hi);
          for (int64_t m = 0; m < p.M; ++m) {
            __m256 a = _mm256_load_ps(acc + m * S + 8 * v);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(p.xl + m * p.Kb + j), lo, a);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(p.xh + m * p.Kb + j), hi, a);
            _mm256_store_ps(acc + m * S + 8 * v, a);
          }
        }
      }
    }
    // Group end: y (+)= scale * (acc - zp * sum of x over the group).
    for (int64_t m = 0; m < p.M; ++m) {
      float* yr = p.y + m * p.N + c0;
      const float xs = p.zp ? p.xsum[m * p.G + g] : 0.f;
      for (int64_t v = 0; v < V; ++v) {
        __m256 t = _mm256_load_ps(acc + m * S + 8 * v);
        if (p.zp) t = _mm256_fnmadd_ps(_mm256_loadu_ps(p.zp + g * p.N + c0 + 8 * v), _mm256_set1_ps(xs), t);
        __m256 prev = g == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(yr + 8 * v);
        _mm256_storeu_ps(yr + 8 * v, _mm256_fmadd_ps(t, _mm256_loadu_ps(p.scale + g * p.N + c0 + 8 * v), prev));
      }
    }
  }
  if (V * 8 < W) wo_scalar(p, 0, p.M, c0 + V * 8, c1);
}

AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

AVX2 inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// nk: R weight rows (outputs n0..n0+R) x MT activation rows. Each row is a contiguous
// dot product: vector partial sums per group, scaled per group, one horizontal sum at
// the end. R rows at once give R independent FMA chains (latency) and R streams.
template <int MT, int R>
AVX2 void wo_nk_block(const WO& p, int64_t m0, int64_t n0) {
  // The rows two blocks ahead are fetched now: the hardware prefetcher alone left a
  // single core at ~60% of its streaming rate on the 28 MB head table.
  if (m0 == 0 && n0 + 3 * R <= p.N)
    for (int64_t off = 0; off < R * p.Kb; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p.q + (n0 + 2 * R) * p.Kb + off), _MM_HINT_T0);
  __m256 tot[MT][R];
  float adj[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) tot[m][r] = _mm256_setzero_ps(), adj[m][r] = 0.f;
  for (int64_t g = 0; g < p.G; ++g) {
    int64_t k0 = g * p.gs, k1 = std::min(p.K, k0 + p.gs);
    __m256 a[MT][R];
    float ts[MT][R];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R; ++r) a[m][r] = _mm256_setzero_ps(), ts[m][r] = 0.f;
    if (!p.int4) {
      int64_t k = k0;
      for (; k + 8 <= k1; k += 8) {
        __m256 xv[MT];
        for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(p.x + (m0 + m) * p.K + k);
        for (int r = 0; r < R; ++r) {
          __m256 w = int8_decode(p.q + (n0 + r) * p.Kb + k);
          for (int m = 0; m < MT; ++m) a[m][r] = _mm256_fmadd_ps(xv[m], w, a[m][r]);
        }
      }
      for (; k < k1; ++k)
        for (int r = 0; r < R; ++r) {
          float w = static_cast<float>(static_cast<int8_t>(p.q[(n0 + r) * p.Kb + k]));
          for (int m = 0; m < MT; ++m) ts[m][r] += p.x[(m0 + m) * p.K + k] * w;
        }
    } else {
      int64_t j = k0 / 2, j1 = cdiv(k1, 2);
      for (; j + 8 <= j1; j += 8) {
        __m256 xl[MT], xh[MT];
        for (int m = 0; m < MT; ++m) {
          xl[m] = _mm256_loadu_ps(p.xl + (m0 + m) * p.Kb + j);
          xh[m] = _mm256_loadu_ps(p.xh + (m0 + m) * p.Kb + j);
        }
        for (int r = 0; r < R; ++r) {
          __m256 lo, hi;
          int4_decode(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.q + (n0 + r) * p.Kb + j)), lo, hi);
          for (int m = 0; m < MT; ++m) {
            a[m][r] = _mm256_fmadd_ps(xl[m], lo, a[m][r]);
            a[m][r] = _mm256_fmadd_ps(xh[m], hi, a[m][r]);
          }
        }
      }
      for (; j < j1; ++j)
        for (int r = 0; r < R; ++r) {
          int b = static_cast<int8_t>(p.q[(n0 + r) * p.Kb + j]);
          float lo = static_cast<float>(static_cast<int32_t>(static_cast<uint32_t>(b) << 28));
          float hi = static_cast<float>(b & ~15);
          for (int m = 0; m < MT; ++m)
            ts[m][r] += p.xl[(m0 + m) * p.Kb + j] * lo + p.xh[(m0 + m) * p.Kb + j] * hi;
        }
    }
    for (int r = 0; r < R; ++r) {
      float s = p.scale[(n0 + r) * p.G + g];
      float z = p.zp ? p.zp[(n0 + r) * p.G + g] : 0.f;
      __m256 sv = _mm256_set1_ps(s);
      for (int m = 0; m < MT; ++m) {
        tot[m][r] = _mm256_fmadd_ps(a[m][r], sv, tot[m][r]);
        float t = ts[m][r];
        if (p.zp) t -= z * p.xsum[(m0 + m) * p.G + g];
        adj[m][r] += s * t;
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) p.y[(m0 + m) * p.N + n0 + r] = hsum(tot[m][r]) + adj[m][r];
}

template <int MT>
AVX2 void wo_nk_rows_mt(const WO& p, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int R = MT == 1 ? 4 : 2;
  int64_t n = n0;
  for (; n + R <= n1; n += R) wo_nk_block<MT, R>(p, m0, n);
  for (; n < n1; ++n) wo_nk_block<MT, 1>(p, m0, n);
}

AVX2 void wo_nk_rows(const WO& p, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) wo_nk_rows_mt<4>(p, m, n0, n1);
  for (; m + 2 <= p.M; m += 2) wo_nk_rows_mt<2>(p, m, n0, n1);
  for (; m < p.M; ++m) wo_nk_rows_mt<1>(p, m, n0, n1);
}
#endif  // LLMEQ_X86

// Output columns (kn) or weight rows (nk) per claimed chunk: 64 columns is one cache
// line of an int8 kernel row; 32 nk rows amortise the counter over ~18 KB of weights.
constexpr int64_t kKnChunk = 64;
constexpr int64_t kMinParallelBytesDefault = 64 * 1024;
constexpr int64_t kNkChunk = 32;
// Below this many weight bytes a product runs on the calling thread only. On the quiet
// 2-core machine a second thread paid off from ~64 KB (whole-model decode, rtn-w4-g128:
// 36.9 tok/s with 64 KB vs fewer with 2 MB); on a loaded machine a pool thread that is
// preempted while it holds a chunk stalls the call, so LLMEQ_NATIVE_PARALLEL_KB raises
// it and LLMEQ_NATIVE_THREADS=1 turns threads off entirely.
int64_t min_parallel_bytes() {
  static const int64_t v = [] {
    const char* env = std::getenv("LLMEQ_NATIVE_PARALLEL_KB");
    return env && std::atoi(env) >= 0 ? int64_t(std::atoi(env)) * 1024 : kMinParallelBytesDefault;
  }();
  return v;
}

#if LLMEQ_X86
void wo_panel_run(const WO& p, ffi::ThreadPool* pool);
void wo_int_panel_run(const WO& p, ffi::ThreadPool* pool);
bool wo_int_panels_ok(const WO& p);
#endif

// silu(gate) * up of a joined product h [M, 2F] into y [M, F].
void swiglu_rows(const float* h, float* y, int64_t M, int64_t F) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < F; ++j) {
      const float g = h[m * 2 * F + j];
      y[m * F + j] = g / (1.f + std::exp(-g)) * h[m * 2 * F + F + j];
    }
}

void wo_run(WO& p, ffi::ThreadPool* pool) {
#if LLMEQ_X86
  if (p.M > kWoPanelMinRows && use_avx512()) {
    if (p.int_bits && use_vnni() && wo_int_panels_ok(p)) wo_int_panel_run(p, pool);
    else wo_panel_run(p, pool);
    return;
  }
#endif
  if (p.swiglu) {  // only the panel GEMM applies the activation in registers; elsewhere a second pass
    std::vector<float> h(p.M * p.N);
    WO joined = p;
    joined.swiglu = false;
    joined.y = h.data();
    wo_run(joined, pool);
    swiglu_rows(h.data(), p.y, p.M, p.N / 2);
    return;
  }
  std::vector<float> xsum, xl, xh;
  if (p.zp) {
    xsum.assign(p.M * p.G, 0.f);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t g = 0; g < p.G; ++g) {
        float s = 0.f;
        for (int64_t k = g * p.gs, k1 = std::min(p.K, k + p.gs); k < k1; ++k) s += p.x[m * p.K + k];
        xsum[m * p.G + g] = s;
      }
    p.xsum = xsum.data();
  }
  bool simd = use_avx2();
  if (p.int4 && simd) {
    xl.assign(p.M * p.Kb, 0.f);
    xh.assign(p.M * p.Kb, 0.f);
    const float lo_scale = std::ldexp(1.f, -28), hi_scale = 1.f / 16.f;
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t k = 0; k < p.K; ++k) {
        float v = p.x[m * p.K + k];
        if (k & 1) xh[m * p.Kb + k / 2] = v * hi_scale;
        else xl[m * p.Kb + k / 2] = v * lo_scale;
      }
    p.xl = xl.data();
    p.xh = xh.data();
  }
  const bool stream = !p.nk && simd && p.M <= kStreamMaxRows;
  // Streaming kn: about four column chunks (multiples of 8) so two threads balance.
  int64_t chunk = p.nk ? kNkChunk : (stream ? std::min<int64_t>(kStreamMaxCols, std::max<int64_t>(64, cdiv(cdiv(p.N, 4), 8) * 8)) : kKnChunk);
  int64_t n_chunks = cdiv(p.N, chunk);
  int64_t bytes = p.Kb * p.N;
  ffi::ThreadPool* use_pool = bytes >= min_parallel_bytes() ? pool : nullptr;
  const WO& c = p;
  parallel_for(use_pool, n_chunks, [&c, chunk, simd, stream](int64_t i) {
    int64_t n0 = i * chunk, n1 = std::min(c.N, n0 + chunk);
#if LLMEQ_X86
    if (simd) {
      if (stream) wo_kn_stream(c, n0, n1);
      else if (c.nk) wo_nk_rows(c, n0, n1);
      else wo_kn_cols(c, n0, n1);
      return;
    }
#endif
    (void)simd;
    wo_scalar(c, 0, c.M, n0, n1);
  });
}

// ----------------------------------------------------------------------------- W8A8

struct W8 {
  const int8_t* x;     // [M, K]
  const int8_t* q;     // [K, N]
  const float* scale;  // [G, N]
  const float* zp;     // [G, N] or nullptr
  const float* sx;     // [M] activation scale per row
  float* y;            // [M, N]
  int64_t M, K, N, gs, G;
  const int32_t* xsum;  // [M, G] (only with zp)
  const int32_t* xpair; // [M, P] GEMM only: (x[k], x[k+1]) int16 pairs, P pairs over all groups
  int64_t P;
  const int8_t* xquad;  // [M, G * gq] VNNI GEMM only: x with each group zero-padded to gq values
  int64_t gq;           // gs rounded up to a multiple of 4 (vpdpbusd sums 4 consecutive k)
};

// Pairs of contraction rows never straddle a group: group g starts at pair g * ppg.
inline int64_t pairs_per_group(const W8& p) { return cdiv(p.gs, 2); }

inline float w8_finish(const W8& p, int64_t m, int64_t g, int64_t n, int32_t acc) {
  float f = static_cast<float>(acc);
  if (p.zp) f -= static_cast<float>(p.xsum[m * p.G + g]) * p.zp[g * p.N + n];
  return f * p.scale[g * p.N + n];
}

void w8_scalar(const W8& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1, bool apply_sx = true) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float tot = 0.f;
      for (int64_t g = 0; g < p.G; ++g) {
        int32_t acc = 0;
        for (int64_t k = g * p.gs, k1 = std::min(p.K, k + p.gs); k < k1; ++k)
          acc += static_cast<int32_t>(p.x[m * p.K + k]) * static_cast<int32_t>(p.q[k * p.N + n]);
        tot += w8_finish(p, m, g, n, acc);
      }
      p.y[m * p.N + n] = apply_sx ? tot * p.sx[m] : tot;
    }
}

#if LLMEQ_X86
inline int32_t pack_pair(int8_t a, int8_t b) {
  return static_cast<int32_t>(static_cast<uint16_t>(static_cast<int16_t>(a)) |
                              (static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(b))) << 16));
}

// Group-end epilogue for 16 columns: int32 pair sums in vpunpck order -> y += (acc - xsum*zp) * s.
AVX2 inline void w8_flush16(const W8& p, int64_t m, int64_t g, int64_t c, __m256i lo, __m256i hi, bool first) {
  __m256i c0 = _mm256_permute2x128_si256(lo, hi, 0x20);  // columns c..c+7
  __m256i c1 = _mm256_permute2x128_si256(lo, hi, 0x31);  // columns c+8..c+15
  __m256i parts[2] = {c0, c1};
  for (int h = 0; h < 2; ++h) {
    __m256 f = _mm256_cvtepi32_ps(parts[h]);
    if (p.zp) {
      __m256 xs = _mm256_set1_ps(static_cast<float>(p.xsum[m * p.G + g]));
      f = _mm256_fnmadd_ps(xs, _mm256_loadu_ps(p.zp + g * p.N + c + 8 * h), f);
    }
    float* yp = p.y + m * p.N + c + 8 * h;
    __m256 prev = first ? _mm256_setzero_ps() : _mm256_loadu_ps(yp);
    _mm256_storeu_ps(yp, _mm256_fmadd_ps(f, _mm256_loadu_ps(p.scale + g * p.N + c + 8 * h), prev));
  }
}

// GEMV-style W8A8 for few rows: kernel rows k, k+1 are sign-extended to int16 and
// interleaved so one vpmaddwd forms x[k] w[k,n] + x[k+1] w[k+1,n] exactly in int32
// (|sum| <= 2 * 128 * 128, far below int32; no vpmaddubsw saturation).
template <int MT, int NU>
AVX2 void w8_gemv_block(const W8& p, int64_t m0, int64_t c0) {
  for (int64_t g = 0; g < p.G; ++g) {
    int64_t k0 = g * p.gs, k1 = std::min(p.K, k0 + p.gs);
    __m256i lo[MT][NU], hi[MT][NU];
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < NU; ++u) lo[m][u] = hi[m][u] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 2) {
      bool pair = k + 1 < k1;
      __m256i xp[MT];
      for (int m = 0; m < MT; ++m) {
        const int8_t* xr = p.x + (m0 + m) * p.K;
        xp[m] = _mm256_set1_epi32(pack_pair(xr[k], pair ? xr[k + 1] : 0));
      }
      const int8_t* r0 = p.q + k * p.N + c0;
      const int8_t* r1 = r0 + p.N;
      for (int u = 0; u < NU; ++u) {
        __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 16 * u)));
        __m256i b = pair ? _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + 16 * u)))
                         : _mm256_setzero_si256();
        __m256i il = _mm256_unpacklo_epi16(a, b), ih = _mm256_unpackhi_epi16(a, b);
        for (int m = 0; m < MT; ++m) {
          lo[m][u] = _mm256_add_epi32(lo[m][u], _mm256_madd_epi16(il, xp[m]));
          hi[m][u] = _mm256_add_epi32(hi[m][u], _mm256_madd_epi16(ih, xp[m]));
        }
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < NU; ++u) w8_flush16(p, m0 + m, g, c0 + 16 * u, lo[m][u], hi[m][u], g == 0);
  }
}

template <int MT>
AVX2 void w8_gemv_cols_mt(const W8& p, int64_t m0, int64_t c0, int64_t c1) {
  constexpr int NU = MT == 1 ? 4 : (MT == 2 ? 2 : 1);
  int64_t c = c0;
  for (; c + 16 * NU <= c1; c += 16 * NU) w8_gemv_block<MT, NU>(p, m0, c);
  for (; c + 16 <= c1; c += 16) w8_gemv_block<MT, 1>(p, m0, c);
  // The SIMD blocks store y without the activation scale; the tail does the same.
  if (c < c1) w8_scalar(p, m0, m0 + MT, c, c1, /*apply_sx=*/false);
  for (int m = 0; m < MT; ++m) {
    float* yp = p.y + (m0 + m) * p.N;
    __m256 s = _mm256_set1_ps(p.sx[m0 + m]);
    int64_t n = c0;
    for (; n + 8 <= c1; n += 8) _mm256_storeu_ps(yp + n, _mm256_mul_ps(_mm256_loadu_ps(yp + n), s));
    for (; n < c1; ++n) yp[n] *= p.sx[m0 + m];
  }
}

AVX2 void w8_gemv_cols(const W8& p, int64_t c0, int64_t c1) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) w8_gemv_cols_mt<4>(p, m, c0, c1);
  for (; m + 2 <= p.M; m += 2) w8_gemv_cols_mt<2>(p, m, c0, c1);
  for (; m < p.M; ++m) w8_gemv_cols_mt<1>(p, m, c0, c1);
}

// ---- GEMM (many rows): packed panels + a 6 x 16 register-blocked micro-kernel.
//
// B panel (16 columns): for each contraction pair, 32 int16 already in the
// vpunpcklo/hi order (64 bytes, two aligned loads). A: int32 (x[k], x[k+1]) pairs
// per row, broadcast with one load. 12 int32 accumulators per tile.

constexpr int kMR = 6;

AVX2 void w8_pack_panel(const W8& p, int64_t c, int16_t* dst) {
  int64_t ppg = pairs_per_group(p);
  for (int64_t g = 0; g < p.G; ++g) {
    int64_t k0 = g * p.gs, k1 = std::min(p.K, k0 + p.gs);
    int16_t* d = dst + g * ppg * 32;
    int64_t k = k0;
    for (int64_t j = 0; j < ppg; ++j, k += 2, d += 32) {
      __m256i a = k < k1 ? _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + k * p.N + c)))
                         : _mm256_setzero_si256();
      __m256i b = k + 1 < k1
                      ? _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + (k + 1) * p.N + c)))
                      : _mm256_setzero_si256();
      _mm256_store_si256(reinterpret_cast<__m256i*>(d), _mm256_unpacklo_epi16(a, b));
      _mm256_store_si256(reinterpret_cast<__m256i*>(d + 16), _mm256_unpackhi_epi16(a, b));
    }
  }
}

template <int MR>
AVX2 void w8_micro(const W8& p, int64_t m0, int64_t c, const int16_t* panel) {
  int64_t ppg = pairs_per_group(p);
  for (int64_t g = 0; g < p.G; ++g) {
    __m256i lo[MR], hi[MR];
    for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
    const int16_t* b = panel + g * ppg * 32;
    const int32_t* a = p.xpair + m0 * p.P + g * ppg;
    for (int64_t j = 0; j < ppg; ++j, b += 32) {
      __m256i bl = _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
      __m256i bh = _mm256_load_si256(reinterpret_cast<const __m256i*>(b + 16));
      for (int m = 0; m < MR; ++m) {
        __m256i xa = _mm256_set1_epi32(a[m * p.P + j]);
        lo[m] = _mm256_add_epi32(lo[m], _mm256_madd_epi16(bl, xa));
        hi[m] = _mm256_add_epi32(hi[m], _mm256_madd_epi16(bh, xa));
      }
    }
    for (int m = 0; m < MR; ++m) w8_flush16(p, m0 + m, g, c, lo[m], hi[m], g == 0);
  }
  for (int m = 0; m < MR; ++m) {
    float* yp = p.y + (m0 + m) * p.N + c;
    __m256 s = _mm256_set1_ps(p.sx[m0 + m]);
    _mm256_storeu_ps(yp, _mm256_mul_ps(_mm256_loadu_ps(yp), s));
    _mm256_storeu_ps(yp + 8, _mm256_mul_ps(_mm256_loadu_ps(yp + 8), s));
  }
}

AVX2 void w8_gemm_panel(const W8& p, int64_t c, int16_t* panel) {
  w8_pack_panel(p, c, panel);
  int64_t m = 0;
  for (; m + kMR <= p.M; m += kMR) w8_micro<kMR>(p, m, c, panel);
  switch (p.M - m) {
    case 5: w8_micro<5>(p, m, c, panel); break;
    case 4: w8_micro<4>(p, m, c, panel); break;
    case 3: w8_micro<3>(p, m, c, panel); break;
    case 2: w8_micro<2>(p, m, c, panel); break;
    case 1: w8_micro<1>(p, m, c, panel); break;
    default: break;
  }
}

// ---- GEMM on AVX-512 VNNI: vpdpbusd sums four u8 x s8 products into each int32 lane.
//
// The weight is the unsigned operand: u = q + 128 = q ^ 0x80 (in [0, 255]), so
//   sum_k u[k,n] x[k] = sum_k q[k,n] x[k] + 128 * xsum[m,g]
// and the exact int32 sum of the AVX2 path is acc - 128 * xsum (|acc| <= gs * 255 * 127,
// checked against int32 by the caller). x (int8, [-127, 127] from quantize_activations)
// is the signed operand, four consecutive k broadcast to all lanes. After that the float
// epilogue is w8_flush16's, so both GEMMs give the same y.
//
// B panel (16 columns): per group, per quad of k, 64 bytes = 16 columns x 4 k (k fastest).

#define VNNI512 __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))

constexpr int kVMR = 8;   // activation rows per micro tile
constexpr int kVNU = 3;   // 16-column panels per micro tile (24 zmm accumulators)

inline int64_t vnni_panel_bytes(const W8& p) { return p.G * p.gq * 16; }

// `np` consecutive 16-column panels of u = q ^ 0x80 starting at column c (panel i at
// dst + i * vnni_panel_bytes); k beyond a group's end (x is 0 there) as 0x80. Walks the
// kernel row by row across all panels: a panel at a time would touch a new page per row
// of a wide kernel (the 49k-column head).
VNNI512 void w8v_pack_panels(const W8& p, int64_t c, int64_t np, uint8_t* dst) {
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  const int64_t pb = vnni_panel_bytes(p);
  for (int64_t g = 0; g < p.G; ++g) {
    int64_t k0 = g * p.gs, k1 = std::min(p.K, k0 + p.gs);
    for (int64_t k = k0; k < k0 + p.gq; k += 4) {
      uint8_t* d = dst + g * p.gq * 16 + (k - k0) * 16;
      for (int64_t i = 0; i < np; ++i, d += pb) {
        __m128i r[4];
        for (int j = 0; j < 4; ++j)
          r[j] = k + j < k1
                     ? _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + (k + j) * p.N + c + 16 * i)), flip)
                     : flip;
        // 4 x 16 byte transpose: each column's 4 k values become contiguous.
        __m128i a_lo = _mm_unpacklo_epi8(r[0], r[1]), a_hi = _mm_unpackhi_epi8(r[0], r[1]);
        __m128i b_lo = _mm_unpacklo_epi8(r[2], r[3]), b_hi = _mm_unpackhi_epi8(r[2], r[3]);
        _mm_store_si128(reinterpret_cast<__m128i*>(d), _mm_unpacklo_epi16(a_lo, b_lo));
        _mm_store_si128(reinterpret_cast<__m128i*>(d + 16), _mm_unpackhi_epi16(a_lo, b_lo));
        _mm_store_si128(reinterpret_cast<__m128i*>(d + 32), _mm_unpacklo_epi16(a_hi, b_hi));
        _mm_store_si128(reinterpret_cast<__m128i*>(d + 48), _mm_unpackhi_epi16(a_hi, b_hi));
      }
    }
  }
}

// Group-end epilogue for 16 columns: y += (acc - 128 xsum - xsum * zp) * s, as w8_flush16;
// after the last group also times the row's activation scale (w8_micro's final pass, done
// here in registers: the same two roundings without another trip through y).
VNNI512 inline void w8v_flush16(const W8& p, int64_t m, int64_t g, int64_t c, __m512i acc) {
  int32_t xs = p.xsum[m * p.G + g];
  __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(128 * xs)));
  if (p.zp) f = _mm512_fnmadd_ps(_mm512_set1_ps(static_cast<float>(xs)), _mm512_loadu_ps(p.zp + g * p.N + c), f);
  float* yp = p.y + m * p.N + c;
  __m512 prev = g == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(yp);
  __m512 y = _mm512_fmadd_ps(f, _mm512_loadu_ps(p.scale + g * p.N + c), prev);
  if (g == p.G - 1) y = _mm512_mul_ps(y, _mm512_set1_ps(p.sx[m]));
  _mm512_storeu_ps(yp, y);
}

// acc += per-lane sums of 4 (u8 a) x (s8 b) products. GCC 12 compiles the intrinsic with a
// copy of the accumulator in and out of a spare register and a spill per instruction; the
// asm ties the accumulator to one register (AT&T operand order: b, a, acc).
VNNI512 inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, a, b);
#endif
}

// The integer part of one group for an MR x (16 NU) tile: out[m][u] = sum over the group's
// quads of u8 weights x s8 activations (a separate function so GCC keeps the 24
// accumulators apart from the epilogue's registers).
template <int MR, int NU>
VNNI512 __attribute__((noinline)) void w8v_dots(const int8_t* a, int64_t lda, const uint8_t* b, int64_t pb,
                                                int64_t quads, __m512i* out) {
  __m512i acc[MR][NU];
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < NU; ++u) acc[m][u] = _mm512_setzero_si512();
  for (int64_t j = 0; j < quads; ++j, b += 64) {
    __m512i w[NU];
    for (int u = 0; u < NU; ++u) w[u] = _mm512_load_si512(reinterpret_cast<const void*>(b + u * pb));
    for (int m = 0; m < MR; ++m) {
      int32_t quad;
      std::memcpy(&quad, a + m * lda + 4 * j, 4);
      const __m512i xa = _mm512_set1_epi32(quad);
      for (int u = 0; u < NU; ++u) acc[m][u] = dpbusd(acc[m][u], w[u], xa);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < NU; ++u) _mm512_store_si512(reinterpret_cast<void*>(out + m * NU + u), acc[m][u]);
}

template <int MR, int NU>
VNNI512 void w8v_micro(const W8& p, int64_t m0, int64_t c, const uint8_t* panels) {
  const int64_t pb = vnni_panel_bytes(p), kq = p.G * p.gq;
  alignas(64) __m512i acc[MR * NU];
  for (int64_t g = 0; g < p.G; ++g) {
    w8v_dots<MR, NU>(p.xquad + m0 * kq + g * p.gq, kq, panels + g * p.gq * 16, pb, p.gq / 4, acc);
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < NU; ++u) w8v_flush16(p, m0 + m, g, c + 16 * u, acc[m * NU + u]);
  }
}

template <int NU>
VNNI512 void w8v_tile(const W8& p, int64_t m, int64_t rows, int64_t c, const uint8_t* panels) {
  switch (rows) {
    case 8: w8v_micro<8, NU>(p, m, c, panels); break;
    case 7: w8v_micro<7, NU>(p, m, c, panels); break;
    case 6: w8v_micro<6, NU>(p, m, c, panels); break;
    case 5: w8v_micro<5, NU>(p, m, c, panels); break;
    case 4: w8v_micro<4, NU>(p, m, c, panels); break;
    case 3: w8v_micro<3, NU>(p, m, c, panels); break;
    case 2: w8v_micro<2, NU>(p, m, c, panels); break;
    case 1: w8v_micro<1, NU>(p, m, c, panels); break;
    default: break;
  }
}

// Columns [n0, n1) of y: packs their whole panels into `panels`, then runs the tiles row
// block by row block (a row block's stores stay on a few pages of y, however wide y is).
VNNI512 void w8v_cols(const W8& p, int64_t n0, int64_t n1, uint8_t* panels) {
  static_assert(kVMR == 8, "w8v_tile dispatches up to 8 rows");
  const int64_t pb = vnni_panel_bytes(p), np = (n1 - n0) / 16;
  w8v_pack_panels(p, n0, np, panels);
  for (int64_t m = 0; m < p.M; m += kVMR) {
    const int64_t rows = std::min<int64_t>(kVMR, p.M - m);
    int64_t i = 0;
    for (; i + kVNU <= np; i += kVNU) w8v_tile<kVNU>(p, m, rows, n0 + 16 * i, panels + i * pb);
    for (; i < np; ++i) w8v_tile<1>(p, m, rows, n0 + 16 * i, panels + i * pb);
  }
  if (n0 + 16 * np < n1) w8_scalar(p, 0, p.M, n0 + 16 * np, n1);
}

// Columns per claimed chunk: up to four micro tiles (fewer page walks while packing a wide
// kernel), but at least ~8 chunks per call so two or more threads stay balanced.
int64_t w8v_chunk(int64_t N) { return 16 * kVNU * std::clamp<int64_t>(N / (16 * kVNU * 8), 1, 4); }

#endif  // LLMEQ_X86

// Rows at or below which W8A8 runs as a GEMV straight from the kernel (no packing).
constexpr int64_t kW8GemvRows = 8;
constexpr int64_t kW8GemmChunk = 32;  // columns per claimed chunk (two panels)

// The VNNI GEMM's int32 sums of u8 (<= 255) x s8 (|x| <= 128) products over one group stay in range.
inline bool w8v_fits(const W8& p) { return p.gs <= (int64_t(1) << 31) / (255 * 128) - 1; }

void w8_run(W8& p, ffi::ThreadPool* pool) {
  std::vector<int32_t> xsum, xpair;
  std::vector<int8_t> xquad;
  bool vnni = use_vnni() && p.M > kW8GemvRows && w8v_fits(p);
  if (p.zp || vnni) {
    xsum.assign(p.M * p.G, 0);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t g = 0; g < p.G; ++g) {
        int32_t s = 0;
        for (int64_t k = g * p.gs, k1 = std::min(p.K, k + p.gs); k < k1; ++k) s += p.x[m * p.K + k];
        xsum[m * p.G + g] = s;
      }
    p.xsum = xsum.data();
  }
  bool simd = use_avx2();
  bool gemm = simd && p.M > kW8GemvRows && !vnni;
#if LLMEQ_X86
  if (vnni) {
    p.gq = cdiv(p.gs, 4) * 4;
    if (p.gq == p.gs && p.G * p.gs == p.K) {
      p.xquad = p.x;  // groups already whole quads: no copy
    } else {
      xquad.assign(p.M * p.G * p.gq, 0);
      for (int64_t m = 0; m < p.M; ++m)
        for (int64_t g = 0; g < p.G; ++g) {
          int64_t k0 = g * p.gs, k1 = std::min(p.K, k0 + p.gs);
          std::memcpy(xquad.data() + (m * p.G + g) * p.gq, p.x + m * p.K + k0, k1 - k0);
        }
      p.xquad = xquad.data();
    }
    const W8& c = p;
    const int64_t chunk = w8v_chunk(p.N);
    parallel_for(pool, cdiv(p.N, chunk), [&c, chunk](int64_t i) {
      int64_t n0 = i * chunk, n1 = std::min(c.N, n0 + chunk);
      // 64-byte aligned scratch for the chunk's panels, reused by this thread across calls.
      thread_local std::vector<uint8_t> buf;
      size_t need = (chunk / 16) * vnni_panel_bytes(c) + 64;
      if (buf.size() < need) buf.resize(need);
      uint8_t* panels = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
      w8v_cols(c, n0, n1, panels);
    });
    return;
  }
  if (gemm) {
    int64_t ppg = pairs_per_group(p);
    p.P = ppg * p.G;
    xpair.assign(p.M * p.P, 0);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t g = 0; g < p.G; ++g) {
        int64_t k0 = g * p.gs, k1 = std::min(p.K, k0 + p.gs);
        for (int64_t j = 0; j < ppg; ++j) {
          int64_t k = k0 + 2 * j;
          int8_t a = k < k1 ? p.x[m * p.K + k] : 0, b = k + 1 < k1 ? p.x[m * p.K + k + 1] : 0;
          xpair[m * p.P + g * ppg + j] = pack_pair(a, b);
        }
      }
    p.xpair = xpair.data();
  }
#endif
  int64_t chunk = gemm ? kW8GemmChunk : kKnChunk;
  int64_t n_chunks = cdiv(p.N, chunk);
  ffi::ThreadPool* use_pool = (p.K * p.N >= min_parallel_bytes() || p.M > kW8GemvRows) ? pool : nullptr;
  const W8& c = p;
  parallel_for(use_pool, n_chunks, [&c, chunk, simd, gemm](int64_t i) {
    int64_t n0 = i * chunk, n1 = std::min(c.N, n0 + chunk);
#if LLMEQ_X86
    if (gemm) {
      int64_t panel_elems = cdiv(c.gs, 2) * c.G * 32;
      // 32-byte aligned scratch for two 64-byte-per-pair panels.
      std::unique_ptr<int16_t[]> buf(new int16_t[panel_elems + 16]);
      int16_t* panel = reinterpret_cast<int16_t*>((reinterpret_cast<uintptr_t>(buf.get()) + 31) & ~uintptr_t(31));
      int64_t n = n0;
      for (; n + 16 <= n1; n += 16) w8_gemm_panel(c, n, panel);
      if (n < n1) w8_scalar(c, 0, c.M, n, n1);
      return;
    }
    if (simd) {
      w8_gemv_cols(c, n0, n1);
      return;
    }
#endif
    (void)simd;
    (void)gemm;
    w8_scalar(c, 0, c.M, n0, n1);
  });
}

// ----------------------------------------------------------------------------- row-major decode kernels
//
// y[M,N] = x[M,K] @ W^T for a weight stored row-major (N, K): each output is one
// contiguous dot product, so each thread streams whole weight rows (ops.decode_layout
// transposes a model's (in, out) kernels into this layout once per generate call).
// The products are integer: the weight's int8 / int4 codes times integer activations,
// summed exactly in int32 and scaled per group:
//
//   mode 0 (int8 weights) and 1 (int4 weights), weight-only: float x is quantized per
//     row and per "flush group" (the weight's group, or 128 along K for per-channel
//     weights) to int16 with scale absmax / 32767. The relative error of that step is
//     at most 2^-16 of its group's absmax, orders below the weights' own rounding.
//     int16 x int8 pairs go through vpmaddwd (16 products per instruction, 2x the
//     float convert + FMA path on this CPU class).
//   mode 2 (int8 weights, W8A8): x arrives as int8 from ops.quantize_activations (the
//     XLA path's numerics) with one scale per row; |w| * (x * sign(w)) through
//     vpmaddubsw is exact for w in [-128, 127], x in [-127, 127] (|pair| <= 32512).
//
// int4 codes v in [-8, 7] are read as u = v + 8 = nibble ^ 8, in [0, 15]; the offset
// (and any zero point) is removed per group with the activation sums:
//   sum_k (v_k - zp) x_k = sum_k u_k x_k - (8 + zp) sum_k x_k.
// int32 headroom: a flush group holds at most 32768 values (checked); per lane a group
// adds at most 2 * 32767 * 128 * (F / 16) for mode 0 (F <= 128 there: < 2^26).
//
//   mode 3, weight-only, "split" rows of int4, int5 or int6 codes (mode 0 / 1's products from 4-6 bits
//     a value). Each 64 values of a row are 32 bytes of low nibbles (byte j: value j in its low half,
//     value j + 32 in its high half) then 8 * hb bytes of their high hb = bits - 4 bits (byte j, bits
//     hb * t ..: value j + 8 * hb * t; none for int4); values are stored unsigned, u = v + 2^(bits-1),
//     removed per group as mode 1 removes 8 (decode_layout.split_codes writes this layout).

struct RM {
  int mode;                 // 0-3 as above
  int hb;                   // mode 3: high bits a value beside its nibble (bits - 4)
  int64_t L;                // layers in a stacked q / scale (1: a single weight)
  int64_t M, N, K, Kb;      // Kb: stored bytes per weight row (K; K / 2 for int4; K * bits / 8 split)
  int64_t G;                // weight scale groups along K (1: per channel)
  int64_t F, FG;            // flush group size (values) and count
  const uint8_t* q;         // (N, Kb)
  const float* scale;       // (N, G), or nullptr with scale codes
  const int8_t* scode;      // (N, G) int8 scale codes, or nullptr: a row's scales are scode * sstep
  const float* sstep;       // (N, G / S) one step per S consecutive groups
  int64_t S;
  float* sbuf;              // with scode: [4, G] the float scales of rows n & 3 of the tile being read
  int sexp;                 // how rm_tile_scales expands codes: 0 scalar, 1 AVX2, 2 AVX-512
  const float* zp;          // (N, G) or nullptr
  const int16_t* x16;       // modes 0/1: [M, xs] int16 (int4: K/2 even-k values, then K/2 odd-k)
  const int8_t* x8;         // mode 2: [M, K]
  const int8_t* xh;         // mode 3: [M, K] the int16 activations' high bytes (signed) ...
  const uint8_t* xl;        // ... and low bytes: x16 = 256 xh + xl
  int64_t xstride;
  const float* sa;          // [M, FG] activation scale per flush group
  const int32_t* xsum;      // [M, FG] sums of the integer activations per flush group
  float* y;                 // [M, N]
};

// Row n's float scales (with scale codes: of a row of the tile rm_tile_scales expanded last; a tile of
// R <= 4 rows starts at a multiple of R, so its rows are n & 3 apart).
inline const float* rm_scale_row(const RM& p, int64_t n) {
  return p.sbuf ? p.sbuf + (n & 3) * p.G : p.scale + n * p.G;
}

// Scale codes (a GGUF K-quant's sub-block scales, with its super-block scales as steps: found exact by
// decode_layout.compact_scales) expanded to float for one tile's rows, just before the tile reads them:
// code * step is the float scale exactly, so the products are those of the float scales, bit for bit,
// from a byte a group instead of four (a fifth of a Q6_K row's bytes at groups of 16). Expanded per
// tile, not per chunk: the few hundred instructions run between the tile's weight loads, which the
// prefetches ahead of them keep in flight (per chunk, they stalled the weight stream).
void rm_expand_row_scalar(const int8_t* c, const float* st, int64_t G, int64_t S, float* o) {
  for (int64_t j = 0; j < G; ++j) o[j] = static_cast<float>(c[j]) * st[j / S];
}

#if LLMEQ_X86
// S a multiple of 8 (groups of 16 or 32: 16 or 8 groups a step of 256 values).
AVX2 void rm_expand_row_avx2(const int8_t* c, const float* st, int64_t G, int64_t S, float* o) {
  for (int64_t j = 0; j < G; j += 8) {
    const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j));
    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8)), _mm256_set1_ps(st[j / S])));
  }
}
#endif

void rm_expand_row_512(const int8_t* c, const float* st, int64_t G, int64_t S, float* o);

inline void rm_tile_scales(const RM& p, int64_t n, int rows) {
  if (!p.sbuf) return;
  const int64_t steps = p.G / p.S;
  for (int r = 0; r < rows; ++r) {
    const int8_t* c = p.scode + (n + r) * p.G;
    const float* st = p.sstep + (n + r) * steps;
    float* o = p.sbuf + ((n + r) & 3) * p.G;
#if LLMEQ_X86
    if (p.sexp == 2) {
      rm_expand_row_512(c, st, p.G, p.S, o);
      continue;
    }
    if (p.sexp == 1) {
      rm_expand_row_avx2(c, st, p.G, p.S, o);
      continue;
    }
#endif
    rm_expand_row_scalar(c, st, p.G, p.S, o);
  }
}

inline float rm_wscale(const RM& p, int64_t n, int64_t f) { return rm_scale_row(p, n)[p.G > 1 ? f : 0]; }
// The unsigned codes' offset: 8 (int4), 2^(bits-1) (split rows), 0 (signed int8 storage).
inline float rm_code_base(const RM& p) { return p.mode == 1 ? 8.f : p.mode == 3 ? static_cast<float>(8 << p.hb) : 0.f; }
inline float rm_offset(const RM& p, int64_t n, int64_t f) {
  return rm_code_base(p) + (p.zp ? p.zp[n * p.G + (p.G > 1 ? f : 0)] : 0.f);
}

// Split-row layout (mode 3): bytes of one 64-value block; where value k of a row of K sits (each
// whole 256 lane-interleaved: value 16i + 4b + j at 64b + 4i + j, rm_tile_split); value k, unsigned.
constexpr int64_t rm_split_block_bytes(int hb) { return 32 + 8 * hb; }
inline int64_t rm_split_position(int64_t K, int64_t k) {
  const int64_t v = k % 256;
  return k < K / 256 * 256 ? k - v + 64 * (v / 4 % 4) + 4 * (v / 16) + v % 4 : k;
}
inline int rm_split_value(const uint8_t* row, int hb, int64_t K, int64_t k) {
  const int64_t pos = rm_split_position(K, k);
  const uint8_t* b = row + (pos / 64) * rm_split_block_bytes(hb);
  const int i = static_cast<int>(pos % 64), per = 8 * hb;
  const int nib = i < 32 ? b[i] & 15 : b[i - 32] >> 4;
  return hb ? nib | (((b[32 + i % per] >> (hb * (i / per))) & ((1 << hb) - 1)) << 4) : nib;
}

// Portable loops over rows [n0, n1), all M: the same integer sums as the SIMD path.
void rm_scalar(const RM& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    rm_tile_scales(p, n, 1);
    const uint8_t* w = p.q + n * p.Kb;
    for (int64_t m = 0; m < p.M; ++m) {
      float tot = 0.f;
      for (int64_t f = 0; f < p.FG; ++f) {
        int64_t k0 = f * p.F, k1 = std::min(p.K, k0 + p.F);
        int64_t acc = 0;
        for (int64_t k = k0; k < k1; ++k) {
          int64_t xv, wv;
          if (p.mode == 2) {
            xv = p.x8[m * p.xstride + k];
            wv = static_cast<int8_t>(w[k]);
          } else if (p.mode == 0) {
            xv = p.x16[m * p.xstride + k];
            wv = static_cast<int8_t>(w[k]);
          } else if (p.mode == 3) {
            xv = p.x16[m * p.xstride + k];
            wv = rm_split_value(w, p.hb, p.K, k);
          } else {
            xv = p.x16[m * p.xstride + (k & 1 ? p.K / 2 : 0) + k / 2];
            wv = ((w[k / 2] >> (k & 1 ? 4 : 0)) & 15) ^ 8;
          }
          acc += xv * wv;
        }
        float s = rm_wscale(p, n, f) * p.sa[m * p.FG + f];
        tot += s * (static_cast<float>(acc) - rm_offset(p, n, f) * static_cast<float>(p.xsum[m * p.FG + f]));
      }
      p.y[m * p.N + n] = tot;
    }
  }
}

// Software prefetch distance of the row-major kernels, in weight bytes ahead of the tile being
// read. A tile reads R short rows (576 bytes for a 576-wide model) side by side; the hardware
// prefetchers barely ramp up on streams that short, and the kernels ran at about half the
// DRAM bandwidth (harness, all SmolLM2-135M int8 weights, 2 threads: 10.5 GB/s). Prefetching
// the bytes 4 KB ahead, one line per 64 bytes read, took it to 15-16 GB/s and whole-model
// decode from 1.98x to 3.0x fp32 (int8); 2-3 KB and 6 KB measured a little worse.
constexpr int64_t kRowMajorPrefetchBytes = 4096;
#if LLMEQ_X86
AVX2 inline int32_t hsum_i32(__m256i v) {
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1));
  return _mm_cvtsi128_si32(a);
}

// One AVX2 step of int4 codes: values k..k+31 (16 bytes) of R weight rows x MT activation rows. The
// int32 lane i sums values k + 4i .. k + 4i + 3 (even k from the low nibbles, odd from the high ones).
template <int MT, int R>
AVX2 inline void rm_int4_step(const RM& p, int64_t m0, const uint8_t* const* wrow, int64_t k, __m256i (&acc)[R][MT]) {
  const __m128i low4 = _mm_set1_epi8(15), flip8 = _mm_set1_epi8(static_cast<char>(0x88));
  const int64_t j = k / 2, half = p.K / 2;  // byte offset: 16 bytes hold k..k+31
  __m256i xe[MT], xo[MT];
  for (int m = 0; m < MT; ++m) {
    const int16_t* xr = p.x16 + (m0 + m) * p.xstride;
    xe[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + j));
    xo[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + half + j));
  }
  for (int r = 0; r < R; ++r) {
    const __m128i b = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow[r] + j)), flip8);
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(b, low4));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low4));
    for (int m = 0; m < MT; ++m)
      acc[r][m] = _mm256_add_epi32(acc[r][m], _mm256_add_epi32(_mm256_madd_epi16(lo, xe[m]), _mm256_madd_epi16(hi, xo[m])));
  }
}

// R weight rows (n0..n0+R) x MT activation rows (m0..m0+MT), all of K. The weight
// vectors are decoded once per step and used by every activation row.
template <int MODE, int MT, int R>
AVX2 void rm_tile(const RM& p, int64_t m0, int64_t n0) {
  __m256 tot[R][MT];
  float corr[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      tot[r][m] = _mm256_setzero_ps();
      corr[r][m] = 0.f;
    }
  const uint8_t* wrow[R];
  for (int r = 0; r < R; ++r) wrow[r] = p.q + (n0 + r) * p.Kb;
  const char* pf = reinterpret_cast<const char*>(p.q + n0 * p.Kb) + kRowMajorPrefetchBytes;
  const __m256i ones16 = _mm256_set1_epi16(1);
  int64_t f = 0;
  if (MODE == 1 && p.F == 16) {
    // int4 in groups of 16 (Q3_K / Q2_K widened): a step of 32 values holds two groups, int32 lanes 0-3
    // group f and 4-7 group f + 1, scaled by a vector holding the two groups' scales in its halves.
    for (; f < p.FG; f += 2) {
      __m256i acc[R][MT];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_si256();
      _mm_prefetch(pf, _MM_HINT_T0);
      pf += 16 * R;
      rm_int4_step<MT, R>(p, m0, wrow, f * 16, acc);
      for (int r = 0; r < R; ++r) {
        const float ws0 = rm_wscale(p, n0 + r, f), ws1 = rm_wscale(p, n0 + r, f + 1);
        const float off0 = rm_offset(p, n0 + r, f), off1 = rm_offset(p, n0 + r, f + 1);
        for (int m = 0; m < MT; ++m) {
          const float* sa = p.sa + (m0 + m) * p.FG + f;
          const int32_t* xs = p.xsum + (m0 + m) * p.FG + f;
          const float s0 = ws0 * sa[0], s1 = ws1 * sa[1];
          const __m256 sv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(s0)), _mm_set1_ps(s1), 1);
          tot[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][m]), sv, tot[r][m]);
          corr[r][m] += s0 * off0 * static_cast<float>(xs[0]) + s1 * off1 * static_cast<float>(xs[1]);
        }
      }
    }
  }
  for (; f < p.FG; ++f) {
    const int64_t k0 = f * p.F, k1 = std::min(p.K, k0 + p.F);
    __m256i acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_si256();
    if (MODE == 0) {
      for (int64_t k = k0; k < k1; k += 16) {
        __m256i xv[MT];
        for (int m = 0; m < MT; ++m)
          xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x16 + (m0 + m) * p.xstride + k));
        _mm_prefetch(pf, _MM_HINT_T0);
        pf += 16 * R;
    for (int r = 0; r < R; ++r) {
          __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow[r] + k)));
          for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_add_epi32(acc[r][m], _mm256_madd_epi16(w, xv[m]));
        }
      }
    } else if (MODE == 1) {
      for (int64_t k = k0; k < k1; k += 32) {
        _mm_prefetch(pf, _MM_HINT_T0);
        pf += 16 * R;
        rm_int4_step<MT, R>(p, m0, wrow, k, acc);
      }
    } else {
      for (int64_t k = k0; k < k1; k += 32) {
        __m256i xv[MT];
        for (int m = 0; m < MT; ++m)
          xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x8 + (m0 + m) * p.xstride + k));
        _mm_prefetch(pf, _MM_HINT_T0);
        _mm_prefetch(pf + 64, _MM_HINT_T0);
        pf += 32 * R;
    for (int r = 0; r < R; ++r) {
          __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow[r] + k));
          __m256i aw = _mm256_abs_epi8(w);
        for (int m = 0; m < MT; ++m)
            acc[r][m] = _mm256_add_epi32(
                acc[r][m], _mm256_madd_epi16(ones16, _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[m], w))));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float ws = rm_wscale(p, n0 + r, f), off = rm_offset(p, n0 + r, f);
      for (int m = 0; m < MT; ++m) {
        const float s = ws * p.sa[(m0 + m) * p.FG + f];
        tot[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][m]), _mm256_set1_ps(s), tot[r][m]);
        corr[r][m] += s * off * static_cast<float>(p.xsum[(m0 + m) * p.FG + f]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) p.y[(m0 + m) * p.N + n0 + r] = hsum(tot[r][m]) - corr[r][m];
}

// A tile: activation rows [m0, ...) times weight rows [n0, ...), as many as its template says.
using RmTile = void (*)(const RM& p, int64_t m0, int64_t n0);

// Weight rows [n0, n1) for one activation tile at m0: R rows a tile (`tile`), then one at a time (`one`),
// each tile's scale codes expanded first where there are some.
template <int R>
void rm_walk_tiles(const RM& p, int64_t m0, int64_t n0, int64_t n1, RmTile tile, RmTile one) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    rm_tile_scales(p, n, R);
    tile(p, m0, n);
  }
  for (; n < n1; ++n) {
    rm_tile_scales(p, n, 1);
    one(p, m0, n);
  }
}

template <int MODE>
AVX2 void rm_rows_simd(const RM& p, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + 2 <= p.M; m += 2) rm_walk_tiles<2>(p, m, n0, n1, rm_tile<MODE, 2, 2>, rm_tile<MODE, 2, 1>);
  for (; m < p.M; ++m) rm_walk_tiles<4>(p, m, n0, n1, rm_tile<MODE, 1, 4>, rm_tile<MODE, 1, 1>);
}

// ---- The same products on AVX-512 VNNI: one vpdpwssd sums 32 int16 x int16 products (modes 0
// and 1) and one vpdpbusd 64 u8 x s8 products (mode 2) into 16 int32 lanes, where the AVX2 tile
// spends a vpmaddwd and a vpaddd on 16. The weights are decoded once per step for all MT
// activation rows, so the work per row falls to about one instruction per 32-64 products: at
// decode's few rows the AVX2 tile was bound by instructions, not by memory (SmolLM2 shapes,
// 8 rows took 3.3-4.8x the time of one).
//
// Mode 2 reads the weights unsigned, u = w ^ 0x80 = w + 128, so the offset removed per group is
// 128 + zp (rm_tile_vnni's `off`), as mode 1 removes 8 + zp. The integer sums are the AVX2 tile's,
// exactly; only the float reduction of the 16 lanes is ordered differently.
#define VNNI512_VL __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

// rm_expand_row_avx2 sixteen codes at a time: S = 8 takes two steps a vector (lanes 0-7, 8-15).
VNNI512_VL void rm_expand_row_512(const int8_t* c, const float* st, int64_t G, int64_t S, float* o) {
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  int64_t j = 0;
  for (; j + 16 <= G; j += 16) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j))));
    const __m512 step = S == 8 ? _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castpd_ps(
                                     _mm_load_sd(reinterpret_cast<const double*>(st + j / 8)))))
                               : _mm512_set1_ps(st[j / S]);
    _mm512_storeu_ps(o + j, _mm512_mul_ps(v, step));
  }
  if (j < G) rm_expand_row_avx2(c + j, st + j / S, G - j, S, o + j);
}

// acc += per-lane sums of 2 int16 x int16 products (see dpbusd on pinning the accumulator).
VNNI512_VL inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#else
  return _mm512_dpwssd_epi32(acc, a, b);
#endif
}

// Values per full step of the K loop: 32 int8 weights (mode 0), 64 int4 (32 bytes), 64 int8 (mode 2).
template <int MODE>
constexpr int64_t rm_vnni_step() { return MODE == 0 ? 32 : 64; }

// One step of K for R weight rows x MT activation rows at value k; `full` false: the last 32
// values of a group that is an odd multiple of 32 (modes 1 and 2; masked loads, zero weights).
template <int MODE, int MT, int R>
VNNI512_VL inline void rm_vnni_step_at(const RM& p, const uint8_t* const* wrow, const void* const* xrow, int64_t k,
                                       bool full, __m512i (&acc)[R][MT]) {
  if (MODE == 0) {
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow[r] + k)));
      for (int m = 0; m < MT; ++m)
        acc[r][m] = dpwssd(acc[r][m], w, _mm512_loadu_si512(static_cast<const int16_t*>(xrow[m]) + k));
    }
  } else if (MODE == 1) {
    const int64_t j = k / 2, half = p.K / 2;
    const __mmask32 xm = full ? ~__mmask32(0) : __mmask32(0xFFFF);
    __m512i xe[MT], xo[MT];
    for (int m = 0; m < MT; ++m) {
      const int16_t* xr = static_cast<const int16_t*>(xrow[m]);
      xe[m] = _mm512_maskz_loadu_epi16(xm, xr + j);
      xo[m] = _mm512_maskz_loadu_epi16(xm, xr + half + j);
    }
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x88));
    const __m512i low4 = _mm512_set1_epi16(15);
    for (int r = 0; r < R; ++r) {
      // Bytes -> 16-bit lanes (the zero-extension leaves 0 above the byte): low nibble = even k,
      // high nibble = odd k, both u = v + 8 in [0, 15]. A half step's upper lanes stay 0.
      const __m256i b = full ? _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow[r] + j)), flip)
                             : _mm256_zextsi128_si256(_mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow[r] + j)),
                                                                    _mm256_castsi256_si128(flip)));
      const __m512i u = _mm512_cvtepu8_epi16(b);
      const __m512i lo = _mm512_and_si512(u, low4), hi = _mm512_srli_epi16(u, 4);
      for (int m = 0; m < MT; ++m) acc[r][m] = dpwssd(dpwssd(acc[r][m], lo, xe[m]), hi, xo[m]);
    }
  } else {
    const __mmask64 km = full ? ~__mmask64(0) : __mmask64(0xFFFFFFFFull);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_maskz_loadu_epi8(km, static_cast<const int8_t*>(xrow[m]) + k);
    for (int r = 0; r < R; ++r) {
      const __m512i u = _mm512_xor_si512(_mm512_maskz_loadu_epi8(km, wrow[r] + k), flip);
      for (int m = 0; m < MT; ++m) acc[r][m] = dpbusd(acc[r][m], u, xv[m]);
    }
  }
}

// Scales of `count` consecutive groups spread over the 16 lanes, 16 / LANES groups a vector: lanes
// [i * LANES, (i + 1) * LANES) <- v[i] (zero for i >= count; only those are read).
template <int LANES>
VNNI512_VL inline __m512 rm_group_lanes(const float* v, int64_t count) {
  const __m512 some = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), v);
  if (LANES == 1) return some;
  constexpr int log2 = LANES == 16 ? 4 : LANES == 8 ? 3 : LANES == 4 ? 2 : 1;
  const __m512i pick = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), log2);
  return _mm512_permutexvar_ps(pick, some);
}

// The integer offsets of every flush group f, removed once per tile after its K loop:
//   corr[r][m] = sum_f ws(r, f) * (base + zp(r, f)) * sa[m, f] * xsum[m, f]
// with base 8 (mode 1's unsigned nibbles), 128 (mode 2's unsigned bytes) or 0, 16 groups a vector
// (summed per group end it had cost as much as the group's dot products at groups of 32).
template <int MODE, int MT, int R>
VNNI512_VL void rm_offsets_vnni(const RM& p, int64_t m0, int64_t n0, float (&corr)[R][MT]) {
  const float base = MODE == 2 ? 128.f : rm_code_base(p);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) corr[r][m] = 0.f;
  if (MODE == 0 && !p.zp) return;
  if (p.G == 1) {  // one scale and zero point a row, several flush groups of 128
    for (int m = 0; m < MT; ++m) {
      float sx = 0.f;
      for (int64_t f = 0; f < p.FG; ++f)
        sx += p.sa[(m0 + m) * p.FG + f] * static_cast<float>(p.xsum[(m0 + m) * p.FG + f]);
      for (int r = 0; r < R; ++r) corr[r][m] = rm_wscale(p, n0 + r, 0) * (base + (p.zp ? p.zp[n0 + r] : 0.f)) * sx;
    }
    return;
  }
  __m512 c[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) c[r][m] = _mm512_setzero_ps();
  for (int64_t f = 0; f < p.FG; f += 16) {
    const __mmask16 km = p.FG - f >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (p.FG - f)) - 1);
    __m512 sx[MT];
    for (int m = 0; m < MT; ++m) {
      const int64_t at = (m0 + m) * p.FG + f;
      sx[m] = _mm512_mul_ps(_mm512_maskz_loadu_ps(km, p.sa + at),
                            _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(km, p.xsum + at)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (n0 + r) * p.G + f;
      __m512 off = _mm512_set1_ps(base);
      if (p.zp) off = _mm512_add_ps(off, _mm512_maskz_loadu_ps(km, p.zp + at));
      const __m512 wo = _mm512_mul_ps(_mm512_maskz_loadu_ps(km, rm_scale_row(p, n0 + r) + f), off);
      for (int m = 0; m < MT; ++m) c[r][m] = _mm512_fmadd_ps(wo, sx[m], c[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) corr[r][m] = _mm512_reduce_add_ps(c[r][m]);
}

// tot += acc * ws * sa for a step whose int32 lanes hold LANES-lane sums of `count` groups from f on
// (LANES 8: lanes 0-7 group f, 8-15 group f + 1; LANES 4: four groups of 4 lanes).
template <int LANES, int MT, int R>
VNNI512_VL inline void rm_flush_groups(const RM& p, int64_t m0, int64_t n0, int64_t f, int64_t count,
                                       const __m512i (&acc)[R][MT], __m512 (&tot)[R][MT]) {
  __m512 sav[MT];
  for (int m = 0; m < MT; ++m) sav[m] = rm_group_lanes<LANES>(p.sa + (m0 + m) * p.FG + f, count);
  for (int r = 0; r < R; ++r) {  // (per-channel weights: one scale a row, flush groups of 128)
    const __m512 wsv = p.G == 1 ? _mm512_set1_ps(rm_wscale(p, n0 + r, 0))
                                : rm_group_lanes<LANES>(rm_scale_row(p, n0 + r) + f, count);
    for (int m = 0; m < MT; ++m)
      tot[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][m]), _mm512_mul_ps(wsv, sav[m]), tot[r][m]);
  }
}

template <int MODE, int MT, int R>
VNNI512_VL void rm_tile_vnni(const RM& p, int64_t m0, int64_t n0) {
  constexpr int64_t step = rm_vnni_step<MODE>();
  constexpr int64_t step_bytes = MODE == 1 ? step / 2 : step;
  __m512 tot[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) tot[r][m] = _mm512_setzero_ps();
  const uint8_t* wrow[R];
  for (int r = 0; r < R; ++r) wrow[r] = p.q + (n0 + r) * p.Kb;
  const void* xrow[MT];
  for (int m = 0; m < MT; ++m)
    xrow[m] = MODE == 2 ? static_cast<const void*>(p.x8 + (m0 + m) * p.xstride) : p.x16 + (m0 + m) * p.xstride;
  // The R rows are contiguous: walk the prefetch pointer through them at the rate they are read.
  const char* pf = reinterpret_cast<const char*>(p.q + n0 * p.Kb) + kRowMajorPrefetchBytes;
  int64_t f = 0;
  if ((MODE == 1 && p.F == 32) || (MODE == 0 && p.F == 16)) {
    // int4 in groups of 32 (llama.cpp's Q4_0 / Q4_1 / Q4_K grids): the loop below would run a masked half
    // step and a group end per 32 values. One full step takes two groups instead: its 16-bit lanes 0-15
    // hold group f and 16-31 group f + 1, so vpdpwssd's int32 lanes 0-7 sum group f and 8-15 group f + 1,
    // and one group end scales both with vectors holding the two groups' scales in their halves.
    // int5-int8 in groups of 16 (llama.cpp's Q6_K) pair up the same way: a mode-0 step is 32 values.
    for (; f + 1 < p.FG; f += 2) {
      __m512i acc[R][MT];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_si512();
      for (int64_t b = 0; b < 32 * R; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
      pf += 32 * R;
      rm_vnni_step_at<MODE, MT, R>(p, wrow, xrow, f * p.F, true, acc);
      rm_flush_groups<8, MT, R>(p, m0, n0, f, 2, acc, tot);
    }
  } else if (MODE == 1 && p.F == 16) {
    // int4 in groups of 16 (llama.cpp's Q3_K / Q2_K grids, widened to int4): a step's int32 lane i sums
    // values 4i..4i+3 of its 64, so four groups take four lanes each; a last pair of groups, a half step.
    for (; f < p.FG; f += 4) {
      const int64_t count = std::min<int64_t>(4, p.FG - f);
      __m512i acc[R][MT];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_si512();
      for (int64_t b = 0; b < 32 * R; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
      pf += 32 * R;
      rm_vnni_step_at<MODE, MT, R>(p, wrow, xrow, f * p.F, count == 4, acc);
      rm_flush_groups<4, MT, R>(p, m0, n0, f, count, acc, tot);
    }
  }
  for (; f < p.FG; ++f) {  // (an odd last group of 32 above: one half step)
    const int64_t k0 = f * p.F, k1 = std::min(p.K, k0 + p.F);
    __m512i acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + step <= k1; k += step) {
      for (int64_t b = 0; b < step_bytes * R; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
      pf += step_bytes * R;
      rm_vnni_step_at<MODE, MT, R>(p, wrow, xrow, k, true, acc);
    }
    if (k < k1) rm_vnni_step_at<MODE, MT, R>(p, wrow, xrow, k, false, acc);  // 32 values (K, F multiples of 32)
    // Group end: scales broadcast once per row, not per (row, row) pair (at groups of 128 the
    // epilogue's per-pair scalar work had cost as much as the group's dot products).
    __m512 sav[MT];
    for (int m = 0; m < MT; ++m) sav[m] = _mm512_set1_ps(p.sa[(m0 + m) * p.FG + f]);
    for (int r = 0; r < R; ++r) {
      const __m512 wsv = _mm512_set1_ps(rm_wscale(p, n0 + r, f));
      for (int m = 0; m < MT; ++m)
        tot[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][m]), _mm512_mul_ps(wsv, sav[m]), tot[r][m]);
    }
  }
  float corr[R][MT];
  rm_offsets_vnni<MODE, MT, R>(p, m0, n0, corr);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) p.y[(m0 + m) * p.N + n0 + r] = _mm512_reduce_add_ps(tot[r][m]) - corr[r][m];
}

// One 64-value block of a split row (mode 3, HB = bits - 4) as 64 unsigned bytes, byte i = value i.
// Both parts are loaded broadcast (the nibbles to both 256-bit halves, the high bits to every 128-bit
// lane or qword), so one variable shift or rotation a qword brings each value's bits into its byte: no
// lane crossing, four vector instructions a block (widening the codes to 16-bit lanes for vpdpwssd
// instead took ten, two of them lane-crossing, and ran the tile at about int8's speed in values).
template <int HB>
VNNI512_VL inline __m512i rm_split_bytes(const uint8_t* block) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
  const __m512i nibbles = _mm512_srlv_epi64(_mm512_broadcast_i64x4(packed), _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0));
  if constexpr (HB == 0) return _mm512_and_si512(nibbles, _mm512_set1_epi8(15));
  // Rotate each value's high bits to bits 4-5 (int6: 128-bit lane t holds values 16t.. at bits 2t) or bit 4
  // (int5: qword q holds values 8q.. at bit q); the mask below drops what the rotation brought along.
  __m512i high;
  if constexpr (HB == 2) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32));
    high = _mm512_rolv_epi64(_mm512_broadcast_i32x4(bits), _mm512_set_epi64(62, 62, 0, 0, 2, 2, 4, 4));
  } else {
    const __m128i bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 32));
    high = _mm512_rolv_epi64(_mm512_broadcastq_epi64(bits), _mm512_set_epi64(61, 62, 63, 0, 1, 2, 3, 4));
  }
  // nibble | (high & top): ternary-logic table 0xF8 is a | (b & c)
  return _mm512_ternarylogic_epi32(_mm512_and_si512(nibbles, _mm512_set1_epi8(15)), high,
                                   _mm512_set1_epi8(HB == 2 ? 0x30 : 0x10), 0xF8);
}

// rm_tile_vnni for split rows, a 64-value block a step. The codes stay bytes: the int16 activations go
// in as their two bytes, x = 256 xh + xl (xh signed, xl unsigned), and u x = 256 (u xh) + (xl u) is two
// vpdpbusd (u <= 63 fits either operand's range), summed apart and joined at each group end.
//
// A step's int32 lane i sums the 4 values at bytes 4i..4i+3. Each whole 256 values of a row are stored
// lane-interleaved (decode_layout.split_codes): byte 4i + j of its block b holds value 16i + 4b + j, so
// after its four blocks lane i holds values 16i..16i+15 -- a group of 16 (Q6_K; Q3_K, Q2_K in int4 slots),
// half of one of 32 (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K) -- and the groups end once per 256 values with
// their scales loaded as one vector, where ending them every block had cost as much as decoding it. The
// last K % 256 values keep their order and end their groups every block. int4 in groups of 16 or 32 ran
// 1.12-1.23x mode 1's tiles (one matrix of 2048-5632 rows, 1-4 activation rows), in groups of 128 as fast.
template <int HB, int MT, int R>
VNNI512_VL void rm_tile_split(const RM& p, int64_t m0, int64_t n0) {
  constexpr int64_t block = rm_split_block_bytes(HB);
  __m512 tot[R][MT];
  __m512i acc_hi[R][MT], acc_lo[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      tot[r][m] = _mm512_setzero_ps();
      acc_hi[r][m] = acc_lo[r][m] = _mm512_setzero_si512();
    }
  const uint8_t* wrow[R];
  for (int r = 0; r < R; ++r) wrow[r] = p.q + (n0 + r) * p.Kb;
  const char* pf = reinterpret_cast<const char*>(p.q + n0 * p.Kb) + kRowMajorPrefetchBytes;
  auto step = [&](int64_t k) VNNI512_VL {  // the 64 values from k: decode, multiply
    for (int64_t b = 0; b < block * R; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
    pf += block * R;
    __m512i xh[MT], xl[MT];
    for (int m = 0; m < MT; ++m) {
      xh[m] = _mm512_loadu_si512(p.xh + (m0 + m) * p.xstride + k);
      xl[m] = _mm512_loadu_si512(p.xl + (m0 + m) * p.xstride + k);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i u = rm_split_bytes<HB>(wrow[r] + (k / 64) * block);
      for (int m = 0; m < MT; ++m) {
        acc_hi[r][m] = dpbusd(acc_hi[r][m], u, xh[m]);
        acc_lo[r][m] = dpbusd(acc_lo[r][m], xl[m], u);
      }
    }
  };
  auto join = [&]() VNNI512_VL {  // acc_lo <- 256 acc_hi + acc_lo
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) {
        acc_lo[r][m] = _mm512_add_epi32(_mm512_slli_epi32(acc_hi[r][m], 8), acc_lo[r][m]);
        acc_hi[r][m] = _mm512_setzero_si512();
      }
  };
  auto done = [&]() VNNI512_VL {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc_lo[r][m] = _mm512_setzero_si512();
  };
  const int64_t whole = p.K / 256 * 256;
  for (int64_t k = 0; k < whole; k += 256) {  // lane i: values k + 16i .. k + 16i + 15
    for (int64_t b = 0; b < 4; ++b) step(k + 64 * b);
    if (p.F > 256 && (k + 256) % p.F && k + 256 != p.K) continue;  // a longer group goes on
    join();
    switch (p.F) {
      case 16: rm_flush_groups<1, MT, R>(p, m0, n0, k / 16, 16, acc_lo, tot); break;
      case 32: rm_flush_groups<2, MT, R>(p, m0, n0, k / 32, 8, acc_lo, tot); break;
      case 64: rm_flush_groups<4, MT, R>(p, m0, n0, k / 64, 4, acc_lo, tot); break;
      case 128: rm_flush_groups<8, MT, R>(p, m0, n0, k / 128, 2, acc_lo, tot); break;
      default: rm_flush_groups<16, MT, R>(p, m0, n0, k / p.F, 1, acc_lo, tot); break;
    }
    done();
  }
  for (int64_t k = whole; k < p.K; k += 64) {  // lane i: values k + 4i .. k + 4i + 3
    step(k);
    if (p.F > 64 && (k + 64) % p.F && k + 64 != p.K) continue;
    join();
    if (p.F == 16) rm_flush_groups<4, MT, R>(p, m0, n0, k / 16, 4, acc_lo, tot);
    else if (p.F == 32) rm_flush_groups<8, MT, R>(p, m0, n0, k / 32, 2, acc_lo, tot);
    else rm_flush_groups<16, MT, R>(p, m0, n0, k / p.F, 1, acc_lo, tot);
    done();
  }
  float corr[R][MT];
  rm_offsets_vnni<3, MT, R>(p, m0, n0, corr);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) p.y[(m0 + m) * p.N + n0 + r] = _mm512_reduce_add_ps(tot[r][m]) - corr[r][m];
}

// Weight rows [n0, n1) for activation rows [m0, m0 + MT): R rows a tile, then one at a time.
template <int MODE, int MT, int R>
VNNI512_VL void rm_rows_vnni_mt(const RM& p, int64_t m0, int64_t n0, int64_t n1) {
  if constexpr (MODE == 3) {  // two accumulators a (row, row) pair: at most 16 of them
    constexpr int RS = MT > 2 && R > 2 ? 2 : R;
    if (p.hb == 0) rm_walk_tiles<RS>(p, m0, n0, n1, rm_tile_split<0, MT, RS>, rm_tile_split<0, MT, 1>);
    else if (p.hb == 1) rm_walk_tiles<RS>(p, m0, n0, n1, rm_tile_split<1, MT, RS>, rm_tile_split<1, MT, 1>);
    else rm_walk_tiles<RS>(p, m0, n0, n1, rm_tile_split<2, MT, RS>, rm_tile_split<2, MT, 1>);
  } else {
    rm_walk_tiles<R>(p, m0, n0, n1, rm_tile_vnni<MODE, MT, R>, rm_tile_vnni<MODE, MT, 1>);
  }
}

// Weight rows a tile by row length: R rows side by side for rows under 1 KB, at most 2 up to 2 KB, one
// row beyond. A tile streams its R rows at once, R streams a thread, which one prefetch pointer walks
// kRowMajorPrefetchBytes ahead. Rows of 1 KB and more streamed from DRAM faster in fewer streams
// (2-core EPYC, batch 1, GB/s of weights over 4 alternated runs: Q6_K-like head 32000 x 2048 int8 in
// groups of 16 23-26 -> 27-34, 2048 x 5632 int8 g16 20-21 -> 21-29, 2048 x 5632 int4 g32 with zero
// points 11-17 -> 20-25, 4096 x 4096 int4 g128 18-24 -> 28-30, 11264 x 2048 int4 g32 with zero points
// 24-30 -> 30-35; per-row prefetches 1 KB ahead instead lost 10-30 % on most shapes); a 576-wide
// model's rows (SmolLM2) keep 4 a tile, where the shared activation loads pay. The AVX2 tiles, bound by
// instructions rather than by the stream, measured no better with fewer rows and keep theirs.
template <int MODE, int MT, int R>
VNNI512_VL void rm_rows_vnni_by_len(const RM& p, int64_t m, int64_t n0, int64_t n1) {
  if (p.Kb < 1024) rm_rows_vnni_mt<MODE, MT, R>(p, m, n0, n1);
  else if (p.Kb <= 2048) rm_rows_vnni_mt<MODE, MT, (R < 2 ? R : 2)>(p, m, n0, n1);
  else rm_rows_vnni_mt<MODE, MT, 1>(p, m, n0, n1);
}

// All activation rows in tiles of up to 4 (one pass over the chunk's weights per tile).
template <int MODE>
VNNI512_VL void rm_rows_vnni(const RM& p, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) rm_rows_vnni_by_len<MODE, 4, 4>(p, m, n0, n1);
  switch (p.M - m) {
    case 3: rm_rows_vnni_by_len<MODE, 3, 2>(p, m, n0, n1); break;
    case 2: rm_rows_vnni_by_len<MODE, 2, 4>(p, m, n0, n1); break;
    case 1: rm_rows_vnni_by_len<MODE, 1, 4>(p, m, n0, n1); break;
    default: break;
  }
}
#endif  // LLMEQ_X86

// Chunk indices [front, back) still unclaimed, taken from either end by compare-and-swap on one word
// (front in the low 32 bits, back in the high 32).
class ChunkRange {
 public:
  void reset(int64_t front, int64_t back) { v_.store(pack(front, back), std::memory_order_relaxed); }
  bool take_front(int64_t& i) { return take(i, true); }
  bool take_back(int64_t& i) { return take(i, false); }

 private:
  static uint64_t pack(int64_t front, int64_t back) { return uint64_t(front) | (uint64_t(back) << 32); }
  bool take(int64_t& i, bool front_end) {
    uint64_t v = v_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = int64_t(v & 0xffffffffu), b = int64_t(v >> 32);
      if (f >= b) return false;
      const uint64_t next = front_end ? pack(f + 1, b) : pack(f, b - 1);
      if (v_.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
        i = front_end ? f : b - 1;
        return true;
      }
    }
  }
  std::atomic<uint64_t> v_{0};
};

// A few persistent worker threads for the row-major kernels. Decode calls come every
// few tens of microseconds; waking a sleeping pool thread per call cost more than the
// second core gave back (the XLA intra-op pool path above measured slower with two
// threads than with one). Workers spin briefly (yielding, so XLA's own threads still
// run) on a job counter, then sleep. A caller that finds the pool busy (concurrent
// FFI calls) runs its job alone; a job's chunks are claimed from an atomic counter,
// so the caller never waits on a chunk nobody took.
class SpinPool {
 public:
  static SpinPool& get() {
    static SpinPool* pool = new SpinPool();  // never destroyed: workers outlive static teardown
    return *pool;
  }
  int workers() const { return static_cast<int>(threads_.size()); }

  // body(i) for i in [0, n), each thread walking its own contiguous share of [0, n) in order, then taking
  // what is left of the others' from their far ends. For chunks of a weight streamed once: a thread's
  // reads stay one sequential stream (its prefetches land in what it reads next), where chunks claimed
  // from one shared counter alternate between the threads and each chunk's start is read cold (int4 g32,
  // 5632 x 2048, two threads: 16 -> 28 GB/s); the far-end stealing keeps a delayed thread from holding
  // the call up.
  void run_ranges(int64_t n, const std::function<void(int64_t)>& body) {
    const int64_t parts = std::min<int64_t>(workers() + 1, n);
    if (parts <= 1) {
      for (int64_t i = 0; i < n; ++i) body(i);
      return;
    }
    std::vector<ChunkRange> ranges(parts);
    for (int64_t t = 0; t < parts; ++t) ranges[t].reset(n * t / parts, n * (t + 1) / parts);
    run(parts, [&](int64_t t) {
      int64_t i;
      while (ranges[t].take_front(i)) body(i);
      for (int64_t u = 1; u < parts; ++u)
        while (ranges[(t + u) % parts].take_back(i)) body(i);
    });
  }

  void run(int64_t n, const std::function<void(int64_t)>& body) {
    std::unique_lock<std::mutex> busy(call_, std::try_to_lock);
    if (!busy.owns_lock() || threads_.empty() || n <= 1) {
      for (int64_t i = 0; i < n; ++i) body(i);
      return;
    }
    auto job = std::make_shared<Job>();
    job->n = n;
    job->body = &body;
    {
      std::lock_guard<std::mutex> lk(m_);
      job_ = job;
      epoch_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work(*job);
    while (job->done.load(std::memory_order_acquire) < n) {
#if LLMEQ_X86
      _mm_pause();
#endif
    }
    std::lock_guard<std::mutex> lk(m_);
    job_.reset();
  }

 private:
  struct Job {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0;
    const std::function<void(int64_t)>* body = nullptr;
  };

  SpinPool() {
    int want = static_cast<int>(std::thread::hardware_concurrency());
    const char* env = std::getenv("LLMEQ_NATIVE_THREADS");
    if (env && std::atoi(env) > 0) want = std::atoi(env);
    for (int i = 1; i < want; ++i) threads_.emplace_back([this] { loop(); });
  }

  static void work(Job& job) {
    int64_t i;
    while ((i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.n) {
      (*job.body)(i);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      // Spin ~100 us (yielding) for the next job, then sleep until one is posted.
      for (int spin = 0; spin < 2000 && epoch_.load(std::memory_order_acquire) == seen; ++spin) {
        if (spin % 16 == 15) std::this_thread::yield();
#if LLMEQ_X86
        else _mm_pause();
#endif
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        seen = epoch_.load(std::memory_order_acquire);
        job = job_;
      }
      if (job) work(*job);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex call_, m_;
  std::condition_variable cv_;
  std::atomic<uint64_t> epoch_{0};
  std::shared_ptr<Job> job_;
};

// Weight rows per claimed chunk: at least ~16 KB of weights, a multiple of 4 rows.
int64_t rm_chunk_rows(const RM& p) {
  int64_t rows = std::max<int64_t>(4, cdiv(16 * 1024, std::max<int64_t>(p.Kb, 1)));
  rows = cdiv(rows, 4) * 4;
  // At least four chunks per thread where the matrix allows it (what a thread that finished first can take).
  int64_t threads = SpinPool::get().workers() + 1;
  int64_t even = cdiv(cdiv(p.N, 4 * threads), 4) * 4;
  return std::max<int64_t>(4, std::min(rows, even));
}

// Rows [n0, n1) of the product, by the widest tiles this CPU runs.
void rm_run_rows(const RM& p, int64_t n0, int64_t n1, bool simd, bool vnni) {
#if LLMEQ_X86
  if (vnni) {
    if (p.mode == 0) rm_rows_vnni<0>(p, n0, n1);
    else if (p.mode == 1) rm_rows_vnni<1>(p, n0, n1);
    else if (p.mode == 2) rm_rows_vnni<2>(p, n0, n1);
    else rm_rows_vnni<3>(p, n0, n1);
    return;
  }
  if (simd && p.mode <= 2) {  // split rows (mode 3) have no AVX2 tile: decode_layout splits for VNNI only
    if (p.mode == 0) rm_rows_simd<0>(p, n0, n1);
    else if (p.mode == 1) rm_rows_simd<1>(p, n0, n1);
    else rm_rows_simd<2>(p, n0, n1);
    return;
  }
#endif
  (void)simd;
  (void)vnni;
  rm_scalar(p, n0, n1);
}

void rm_run(const RM& p) {
  const bool simd = use_avx2(), vnni = use_vnni();
  int64_t chunk = rm_chunk_rows(p);
  int64_t n_chunks = cdiv(p.N, chunk);
  auto body = [&p, chunk, simd, vnni](int64_t i) {
    int64_t n0 = i * chunk, n1 = std::min(p.N, n0 + chunk);
    if (p.scode) {  // a per-thread buffer for rm_tile_scales
      thread_local std::vector<float> tile_scales;
      tile_scales.resize(4 * p.G);
      RM view = p;
      view.sbuf = tile_scales.data();
      view.sexp = vnni && (p.S == 8 || p.S == 16) ? 2 : simd && p.S % 8 == 0 ? 1 : 0;
      rm_run_rows(view, n0, n1, simd, vnni);
    } else {
      rm_run_rows(p, n0, n1, simd, vnni);
    }
  };
  if (p.N * p.Kb < min_parallel_bytes()) {
    for (int64_t i = 0; i < n_chunks; ++i) body(i);
  } else {
    SpinPool::get().run_ranges(n_chunks, body);
  }
}

// Largest |x[k]| of a flush group; NaN if any x[k] is NaN (then the group's outputs are NaN, as a
// float matmul's would be).
float rm_abs_max(const float* x, int64_t n) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t k = 0; k < n; ++k) {
    amax = std::max(amax, std::fabs(x[k]));
    nan |= std::isnan(x[k]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

// One flush group of activations to int16: q[i] = round(x[i] * inv) (mode 1: even k to q, odd k
// to q + K / 2, see RM::x16); returns their sum. round is to nearest even, as lrintf does.
int32_t rm_round_scalar(const float* x, int64_t n, float inv, bool split, int16_t* q, int64_t half) {
  int32_t s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int16_t v = static_cast<int16_t>(std::lrintf(x[i] * inv));
    s += v;
    if (split) q[(i & 1) * half + i / 2] = v;
    else q[i] = v;
  }
  return s;
}

#if LLMEQ_X86
AVX2 float rm_abs_max_avx2(const float* x, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan)) return std::numeric_limits<float>::quiet_NaN();
  return hmax(amax);
}

// 16 values from x to int16 in k order (packs_epi32 interleaves the two 128-bit lanes; the
// permute puts them back). |x * inv| <= 32767, so the saturating pack is exact.
AVX2 inline __m256i rm_round16(const float* x, __m256 inv, __m256i& sum) {
  const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inv));
  const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), inv));
  sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
}

// rm_round_scalar for n a multiple of 16 (flush groups are multiples of 32, or 16).
AVX2 int32_t rm_round_avx2(const float* x, int64_t n, float inv, bool split, int16_t* q, int64_t half) {
  const __m256 vinv = _mm256_set1_ps(inv);
  // Per 128-bit lane of 8 int16: the 4 even-k values, then the 4 odd-k values.
  const __m256i even_odd = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  __m256i sum = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; i += 16) {
    __m256i v = rm_round16(x + i, vinv, sum);
    if (split) {
      v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, even_odd), 0xD8);  // 8 even k, then 8 odd k
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i / 2), _mm256_castsi256_si128(v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + half + i / 2), _mm256_extracti128_si256(v, 1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), v);
    }
  }
  return hsum_i32(sum);
}
#endif

// One flush group of n activations to int16 codes q (rm_round_*'s layout; simd: n a multiple of 16) with
// scale absmax / 32767, which it returns, their sum in `sum`. A zero group gets scale 0 and no codes; a
// non-finite one scale NaN, so that its outputs are NaN as a float matmul's would be.
// Whether a group's absmax leaves nothing to quantize -- zero (scale 0, no codes) or not finite (scale NaN, so
// that its outputs are NaN as a float matmul's would be) -- with that scale in `scale`.
inline bool rm_degenerate_group(float amax, float& scale) {
  if (amax > 0.f && std::isfinite(amax)) return false;
  scale = amax > 0.f || std::isnan(amax) ? std::numeric_limits<float>::quiet_NaN() : 0.f;
  return true;
}

float rm_quantize_group(const float* x, int64_t n, bool simd, bool split, int16_t* q, int64_t half, int32_t& sum) {
  float amax;
#if LLMEQ_X86
  amax = simd ? rm_abs_max_avx2(x, n) : rm_abs_max(x, n);
#else
  (void)simd;
  amax = rm_abs_max(x, n);
#endif
  sum = 0;
  if (float scale; rm_degenerate_group(amax, scale)) return scale;
  const float inv = 32767.f / amax;
#if LLMEQ_X86
  sum = simd ? rm_round_avx2(x, n, inv, split, q, half) : rm_round_scalar(x, n, inv, split, q, half);
#else
  sum = rm_round_scalar(x, n, inv, split, q, half);
#endif
  return amax / 32767.f;
}

// Weight-only activations: int16 per (row, flush group) with scale absmax / 32767 (RM::x16's layout).
void rm_quantize_x16(const float* x, RM& p, std::vector<int16_t>& xq, std::vector<float>& sa,
                     std::vector<int32_t>& xsum) {
  xq.assign(p.M * p.K, 0);
  sa.assign(p.M * p.FG, 0.f);
  xsum.assign(p.M * p.FG, 0);
  const bool split = p.mode == 1, simd = use_avx2();
  for (int64_t m = 0; m < p.M; ++m) {
    const float* xr = x + m * p.K;
    for (int64_t f = 0; f < p.FG; ++f) {
      const int64_t k0 = f * p.F, n = std::min(p.K, k0 + p.F) - k0;
      // k0 is even: in mode 1 the group's even k start at k0 / 2, its odd k at K / 2 + k0 / 2.
      int16_t* q = xq.data() + m * p.K + (split ? k0 / 2 : k0);
      sa[m * p.FG + f] = rm_quantize_group(xr + k0, n, simd, split, q, p.K / 2, xsum[m * p.FG + f]);
    }
  }
  p.x16 = xq.data();
  p.xstride = p.K;
  p.sa = sa.data();
  p.xsum = xsum.data();
}

// The split tiles' activations (mode 3): each int16 value as its high byte (signed) and low byte, in
// the weights' order (rm_tile_split): each whole 256 lane-interleaved, value 16i + 4b + j at 64b + 4i + j,
// i.e. the 4-value quads of a 256 transposed as a 16 x 4 matrix.
void rm_split_activations(RM& p, std::vector<int8_t>& xh, std::vector<uint8_t>& xl) {
  std::vector<int16_t> ordered(p.x16, p.x16 + p.M * p.K);
  const int64_t whole = p.K / 256 * 256;
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t c = 0; c < whole; c += 256) {
      const int16_t* src = p.x16 + m * p.K + c;
      int16_t* dst = ordered.data() + m * p.K + c;
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t b = 0; b < 4; ++b) std::memcpy(dst + 64 * b + 4 * i, src + 16 * i + 4 * b, 4 * sizeof(int16_t));
    }
  xh.resize(p.M * p.K);
  xl.resize(p.M * p.K);
  for (int64_t k = 0; k < p.M * p.K; ++k) {  // (vectorized by the compiler)
    xh[k] = static_cast<int8_t>(ordered[k] >> 8);
    xl[k] = static_cast<uint8_t>(ordered[k] & 0xFF);
  }
  p.xh = xh.data();
  p.xl = xl.data();
}

// ----------------------------------------------------------------------------- FFI handlers

ffi::Error wo_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale,
                   ffi::Buffer<ffi::F32> zp, ffi::ResultBuffer<ffi::F32> y, int64_t layout, int64_t bits,
                   int64_t group_size, int64_t has_zp, int64_t swiglu, int64_t int_panels) {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("llmeq_wo_matmul: x, q and y must be 2-D");
  if (q.element_type() != ffi::S8 && q.element_type() != ffi::U8)
    return ffi::Error::InvalidArgument("llmeq_wo_matmul: q must be int8 or uint8");
  if (bits < 3 || bits > 8) return ffi::Error::InvalidArgument("llmeq_wo_matmul: bits must be in 3..8");
  WO p{};
  p.M = xd[0];
  p.K = xd[1];
  p.nk = layout == 1;
  p.swiglu = swiglu != 0;
  p.int_bits = int_panels == 8 ? 8 : int_panels ? 16 : 0;
  if (p.swiglu && p.nk) return ffi::Error::InvalidArgument("llmeq_wo_matmul: swiglu needs the kn layout");
  p.N = p.swiglu ? 2 * yd[1] : yd[1];
  p.int4 = bits <= 4;
  p.Kb = p.int4 ? cdiv(p.K, 2) : p.K;
  p.gs = group_size;
  if (p.gs <= 0 || (p.int4 && p.gs % 2 && p.gs < p.K))
    return ffi::Error::InvalidArgument("llmeq_wo_matmul: bad group size (int4 groups must be even)");
  p.G = cdiv(p.K, p.gs);
  int64_t want0 = p.nk ? p.N : p.Kb, want1 = p.nk ? p.Kb : p.N;
  if (yd[0] != p.M || qd[0] != want0 || qd[1] != want1)
    return ffi::Error::InvalidArgument("llmeq_wo_matmul: q / y shapes do not match x");
  int64_t sd0 = p.nk ? p.N : p.G, sd1 = p.nk ? p.G : p.N;
  auto sd = scale.dimensions();
  if (sd.size() != 2 || sd[0] != sd0 || sd[1] != sd1)
    return ffi::Error::InvalidArgument("llmeq_wo_matmul: scale must be (G, N) for kn or (N, G) for nk");
  if (has_zp && (zp.dimensions().size() != 2 || zp.dimensions()[0] != sd0 || zp.dimensions()[1] != sd1))
    return ffi::Error::InvalidArgument("llmeq_wo_matmul: zero point must have the scale's shape");
  p.x = x.typed_data();
  p.q = static_cast<const uint8_t*>(q.untyped_data());
  p.scale = scale.typed_data();
  p.zp = has_zp ? zp.typed_data() : nullptr;
  p.y = y->typed_data();
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {  // silu(0) * 0 = 0 too
    std::memset(p.y, 0, sizeof(float) * p.M * yd[1]);
    return ffi::Error::Success();
  }
  wo_run(p, &pool);
  return ffi::Error::Success();
}

ffi::Error w8_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                   ffi::Buffer<ffi::F32> zp, ffi::Buffer<ffi::F32> sx, ffi::ResultBuffer<ffi::F32> y,
                   int64_t group_size, int64_t has_zp) {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("llmeq_w8a8_matmul: x, q and y must be 2-D");
  W8 p{};
  p.M = xd[0];
  p.K = xd[1];
  p.N = qd[1];
  p.gs = group_size;
  if (p.gs <= 0) return ffi::Error::InvalidArgument("llmeq_w8a8_matmul: bad group size");
  p.G = cdiv(p.K, p.gs);
  if (qd[0] != p.K || yd[0] != p.M || yd[1] != p.N)
    return ffi::Error::InvalidArgument("llmeq_w8a8_matmul: q / y shapes do not match x");
  auto sd = scale.dimensions();
  if (sd.size() != 2 || sd[0] != p.G || sd[1] != p.N)
    return ffi::Error::InvalidArgument("llmeq_w8a8_matmul: scale must be (G, N)");
  if (has_zp && (zp.dimensions().size() != 2 || zp.dimensions()[0] != p.G || zp.dimensions()[1] != p.N))
    return ffi::Error::InvalidArgument("llmeq_w8a8_matmul: zero point must have the scale's shape");
  if (sx.element_count() != static_cast<size_t>(p.M))
    return ffi::Error::InvalidArgument("llmeq_w8a8_matmul: activation scale must have one entry per row");
  p.x = x.typed_data();
  p.q = q.typed_data();
  p.scale = scale.typed_data();
  p.zp = has_zp ? zp.typed_data() : nullptr;
  p.sx = sx.typed_data();
  p.y = y->typed_data();
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {
    std::memset(p.y, 0, sizeof(float) * p.M * p.N);
    return ffi::Error::Success();
  }
  w8_run(p, &pool);
  return ffi::Error::Success();
}


// Shared checks of the row-major handlers; fills p's shapes, weight pointers and flush groups.
ffi::Error rm_setup(RM& p, const char* name, int64_t M, int64_t K, ffi::Span<const int64_t> qd,
                    ffi::Span<const int64_t> sd, ffi::Span<const int64_t> zd, bool has_zp, int64_t group_size,
                    int64_t max_flush) {
  auto bad = [name](const char* why) { return ffi::Error::InvalidArgument(std::string(name) + ": " + why); };
  // q and scale may be stacks [L, ...] of the 2-D arrays (the scan over stacked blocks): the caller
  // picks one layer by offsetting the pointers (rm_pick_layer).
  if (qd.size() != sd.size() || (qd.size() != 2 && qd.size() != 3)) return bad("q and scale must be 2-D, or both 3-D stacks");
  const size_t o = qd.size() - 2;
  p.L = o ? qd[0] : 1;
  if (o && sd[0] != p.L) return bad("q and scale must stack the same number of layers");
  p.M = M;
  p.K = K;
  p.N = qd[o];
  p.Kb = p.mode == 1 ? K / 2 : p.mode == 3 ? K / 64 * rm_split_block_bytes(p.hb) : K;
  if (K % 32) return bad("K must be a multiple of 32");
  if (p.mode == 3 && K % 64) return bad("split rows need K a multiple of 64");
  if (qd[o + 1] != p.Kb) return bad("q must be (N, K) int8, (N, K/2) packed int4 or (N, K * bits / 8) split rows");
  if (group_size <= 0) return bad("bad group size");
  p.G = cdiv(K, group_size);
  if (sd[o] != p.N || sd[o + 1] != p.G) return bad("scale must be (N, ceil(K / group_size))");
  if (has_zp && (zd.size() != 2 || zd[0] != p.N || zd[1] != p.G)) return bad("zero point must have the scale's shape");
  if (p.G > 1) {
    // Groups of 16 (llama.cpp's Q6_K, and Q3_K / Q2_K widened to int4) weight-only: int8-stored codes step
    // 16 values (AVX2) or pair groups (VNNI), int4 codes take two groups an AVX2 step and four a VNNI
    // step; K a multiple of 32 gives whole pairs.
    if (group_size % 32 && !(group_size == 16 && p.mode != 2))
      return bad("groups must be multiples of 32 values (or 16, weight-only)");
    if (group_size > max_flush) return bad("groups are too long for int32 sums");
    if (p.mode == 3 && (group_size > 256 ? group_size % 256 : 256 % group_size))
      return bad("split rows need groups of 16, 32, 64, 128, 256 or a multiple of 256 values");
    p.F = group_size;
  } else {
    p.F = std::min<int64_t>(K, max_flush);
  }
  p.FG = cdiv(K, p.F);
  return ffi::Error::Success();
}

// Point q and scale at layer `layer` of a stack (rm_setup checked the shapes); an error outside it.
ffi::Error rm_pick_layer(RM& p, const char* name, ffi::Buffer<ffi::S32> layer) {
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument(std::string(name) + ": layer must be one int32");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= p.L) return ffi::Error::InvalidArgument(std::string(name) + ": layer index outside the stack");
  p.q += l * p.N * p.Kb;
  if (p.scode) {
    p.scode += l * p.N * p.G;
    p.sstep += l * p.N * (p.G / p.S);
  } else {
    p.scale += l * p.N * p.G;
  }
  return ffi::Error::Success();
}

// Scales as int8 codes (`scale` S8, shaped as float scales) times float32 `steps`, one per `step_groups`
// consecutive groups of a row ((N, G / step_groups), or stacked as q): rm_tile_scales.
ffi::Error rm_scale_codes(RM& p, const char* name, ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> steps,
                          int64_t step_groups) {
  auto bad = [name](const char* why) { return ffi::Error::InvalidArgument(std::string(name) + ": " + why); };
  if (scale.element_type() == ffi::DataType::F32) {
    p.scale = static_cast<const float*>(scale.untyped_data());
    return ffi::Error::Success();
  }
  if (scale.element_type() != ffi::DataType::S8) return bad("scale must be float32, or int8 codes with steps");
  if (step_groups <= 0 || p.G % step_groups) return bad("step_groups must divide the scale groups of a row");
  auto sd = steps.dimensions();
  const size_t o = scale.dimensions().size() - 2;  // 1 for a stack (rm_setup matched it to q)
  if (sd.size() != 2 + o || (o && sd[0] != p.L) || sd[o] != p.N || sd[o + 1] != p.G / step_groups)
    return bad("steps must be (N, groups / step_groups), stacked as q");
  p.scode = static_cast<const int8_t*>(scale.untyped_data());
  p.sstep = steps.typed_data();
  p.S = step_groups;
  return ffi::Error::Success();
}

ffi::Error rm_a16_impl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> zp,
                       ffi::Buffer<ffi::F32> steps, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                       int64_t bits, int64_t group_size, int64_t has_zp, int64_t step_groups, int64_t split) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || y->dimensions().size() != 2) return ffi::Error::InvalidArgument("llmeq_rm_a16: x and y must be 2-D");
  if (bits < 3 || bits > 8) return ffi::Error::InvalidArgument("llmeq_rm_a16: bits must be in 3..8");
  RM p{};
  if (split && (bits < 4 || bits > 6)) return ffi::Error::InvalidArgument("llmeq_rm_a16: split rows are int4-int6");
  p.mode = split ? 3 : bits <= 4 ? 1 : 0;
  p.hb = split ? static_cast<int>(bits) - 4 : 0;
  // Per-channel weights flush every 128 values (the activations' int16 groups).
  auto err = rm_setup(p, "llmeq_rm_a16", xd[0], xd[1], q.dimensions(), scale.dimensions(), zp.dimensions(), has_zp,
                      group_size, group_size >= xd[1] ? 128 : 2048);
  if (!err.success()) return err;
  if (y->dimensions()[0] != p.M || y->dimensions()[1] != p.N) return ffi::Error::InvalidArgument("llmeq_rm_a16: y must be (M, N)");
  p.q = static_cast<const uint8_t*>(q.untyped_data());
  err = rm_scale_codes(p, "llmeq_rm_a16", scale, steps, step_groups);
  if (!err.success()) return err;
  err = rm_pick_layer(p, "llmeq_rm_a16", layer);
  if (!err.success()) return err;
  p.zp = has_zp ? zp.typed_data() : nullptr;
  p.y = y->typed_data();
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {
    std::memset(p.y, 0, sizeof(float) * p.M * p.N);
    return ffi::Error::Success();
  }
  std::vector<int16_t> xq;
  std::vector<float> sa;
  std::vector<int32_t> xsum;
  rm_quantize_x16(x.typed_data(), p, xq, sa, xsum);
  std::vector<int8_t> xh;
  std::vector<uint8_t> xl;
  if (p.mode == 3) rm_split_activations(p, xh, xl);
  rm_run(p);
  return ffi::Error::Success();
}

ffi::Error rm_a8_impl(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                      ffi::Buffer<ffi::F32> zp, ffi::Buffer<ffi::F32> sx, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y, int64_t group_size, int64_t has_zp) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || y->dimensions().size() != 2) return ffi::Error::InvalidArgument("llmeq_rm_a8: x and y must be 2-D");
  RM p{};
  p.mode = 2;
  auto err = rm_setup(p, "llmeq_rm_a8", xd[0], xd[1], q.dimensions(), scale.dimensions(), zp.dimensions(), has_zp,
                      group_size, 4096);
  if (!err.success()) return err;
  if (y->dimensions()[0] != p.M || y->dimensions()[1] != p.N) return ffi::Error::InvalidArgument("llmeq_rm_a8: y must be (M, N)");
  if (sx.element_count() != static_cast<size_t>(p.M))
    return ffi::Error::InvalidArgument("llmeq_rm_a8: activation scale must have one entry per row");
  p.q = reinterpret_cast<const uint8_t*>(q.typed_data());
  p.scale = scale.typed_data();
  err = rm_pick_layer(p, "llmeq_rm_a8", layer);
  if (!err.success()) return err;
  p.zp = has_zp ? zp.typed_data() : nullptr;
  p.y = y->typed_data();
  p.x8 = x.typed_data();
  p.xstride = p.K;
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  std::vector<float> sa(p.M * p.FG);
  std::vector<int32_t> xsum(p.M * p.FG, 0);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t f = 0; f < p.FG; ++f) {
      sa[m * p.FG + f] = sx.typed_data()[m];
      int32_t s = 0;
      for (int64_t k = f * p.F, k1 = std::min(p.K, (f + 1) * p.F); k < k1; ++k) s += p.x8[m * p.K + k];
      xsum[m * p.FG + f] = s;
    }
  p.sa = sa.data();
  p.xsum = xsum.data();
  rm_run(p);
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------- float decode GEMV
//
// llmeq_float_gemv: y[M,N] = x[M,K] @ w[K,N] for a float32 or bfloat16 (in, out) kernel and a few
// activation rows (decode). w may be a stack [L, K, N] (the lax.scan over stacked decoder blocks):
// the kernel reads layer `layer` in place by offsetting its pointer, where XLA's dot first copies the
// layer's slice out of the stack (a 4x slower scanned float decode on a CPU: docs/models.md).
// The kernel rows are streamed as wo_kn_stream streams codes: each task owns a column chunk and walks
// every k, four rows side by side, so memory sees a few long sequential streams.

struct FG {
  int64_t L, M, N, K;
  const float* x;       // [M, K]
  const float* w32;     // [K, N] float32 (or nullptr)
  const uint16_t* w16;  // [K, N] bfloat16 bits (or nullptr)
  float* y;             // [M, N]
};

inline float fg_weight(const FG& p, int64_t k, int64_t n) {
  if (p.w32) return p.w32[k * p.N + n];
  uint32_t bits = uint32_t(p.w16[k * p.N + n]) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

void fg_scalar(const FG& p, int64_t m0, int64_t m1, int64_t c0, int64_t c1) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t n = c0; n < c1; ++n) {
      float s = 0.f;
      for (int64_t k = 0; k < p.K; ++k) s += p.x[m * p.K + k] * fg_weight(p, k, n);
      p.y[m * p.N + n] = s;
    }
}

#if LLMEQ_X86
template <bool kBf16>
AVX2 inline __m256 fg_load8(const FG& p, int64_t k, int64_t c) {
  if constexpr (kBf16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.w16 + k * p.N + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(p.w32 + k * p.N + c);
  }
}

// Rows [m0, m0 + MT) (MT <= kStreamMaxRows) x columns [c0, c1) (MT * (c1 - c0) <= kFloatAccFloats).
// The accumulators (32 KB) stay in L1; the kernel rows kFloatPrefetchRows ahead are prefetched (a chunk's
// row segments are a few KB apart by the row stride, runs too short for the hardware prefetchers to
// ramp up on: 2-core Xeon, 4096 x 11008 float32 at M = 1, 21.6 -> 26.5 GB/s with the prefetch and one
// wide chunk per thread instead of four narrow ones).
constexpr int64_t kFloatAccFloats = 8192;
constexpr int64_t kFloatPrefetchRows = 8;
template <bool kBf16>
AVX2 void fg_stream(const FG& p, int64_t m0, int64_t MT, int64_t c0, int64_t c1) {
  const int64_t W = c1 - c0, V = W / 8;
  alignas(64) float acc[kFloatAccFloats];
  std::fill(acc, acc + MT * V * 8, 0.f);
  int64_t k = 0;
  for (; k + 4 <= p.K; k += 4) {
    for (int64_t v = 0; v < V; ++v) {
      const int64_t c = c0 + 8 * v;
      __m256 w0 = fg_load8<kBf16>(p, k, c), w1 = fg_load8<kBf16>(p, k + 1, c);
      __m256 w2 = fg_load8<kBf16>(p, k + 2, c), w3 = fg_load8<kBf16>(p, k + 3, c);
      if ((v & (kBf16 ? 3 : 1)) == 0 && k + kFloatPrefetchRows + 4 <= p.K) {  // one prefetch per 64-byte line
        for (int64_t r = k + kFloatPrefetchRows; r < k + kFloatPrefetchRows + 4; ++r) {
          const char* a = kBf16 ? reinterpret_cast<const char*>(p.w16 + r * p.N + c)
                                : reinterpret_cast<const char*>(p.w32 + r * p.N + c);
          _mm_prefetch(a, _MM_HINT_T0);
        }
      }
      for (int64_t m = 0; m < MT; ++m) {
        const float* xm = p.x + (m0 + m) * p.K + k;
        __m256 a = _mm256_load_ps(acc + m * V * 8 + 8 * v);
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(xm), w0, a);
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 1), w1, a);
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 2), w2, a);
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 3), w3, a);
        _mm256_store_ps(acc + m * V * 8 + 8 * v, a);
      }
    }
  }
  for (; k < p.K; ++k)
    for (int64_t v = 0; v < V; ++v) {
      __m256 w0 = fg_load8<kBf16>(p, k, c0 + 8 * v);
      for (int64_t m = 0; m < MT; ++m) {
        __m256 a = _mm256_load_ps(acc + m * V * 8 + 8 * v);
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(p.x + (m0 + m) * p.K + k), w0, a);
        _mm256_store_ps(acc + m * V * 8 + 8 * v, a);
      }
    }
  for (int64_t m = 0; m < MT; ++m)
    for (int64_t v = 0; v < V; ++v) _mm256_storeu_ps(p.y + (m0 + m) * p.N + c0 + 8 * v, _mm256_load_ps(acc + m * V * 8 + 8 * v));
  if (V * 8 < W) fg_scalar(p, m0, m0 + MT, c0 + V * 8, c1);
}
#endif  // LLMEQ_X86

void fg_run(const FG& p) {
  const bool simd = use_avx2();
  // One column chunk a thread (multiples of 8) where the accumulators allow: long row segments.
  const int64_t threads = SpinPool::get().workers() + 1;
  const int64_t mt = std::min(kStreamMaxRows, p.M);
  const int64_t chunk = std::min<int64_t>(kFloatAccFloats / mt / 8 * 8, std::max<int64_t>(64, cdiv(cdiv(p.N, threads), 8) * 8));
  const int64_t n_chunks = cdiv(p.N, chunk);
  auto body = [&p, chunk, simd](int64_t i) {
    const int64_t c0 = i * chunk, c1 = std::min(p.N, c0 + chunk);
    for (int64_t m0 = 0; m0 < p.M; m0 += kStreamMaxRows) {
      const int64_t mt = std::min(kStreamMaxRows, p.M - m0);
#if LLMEQ_X86
      if (simd) {
        if (p.w16) fg_stream<true>(p, m0, mt, c0, c1);
        else fg_stream<false>(p, m0, mt, c0, c1);
        continue;
      }
#endif
      fg_scalar(p, m0, m0 + mt, c0, c1);
    }
  };
  (void)simd;
  const int64_t bytes = p.K * p.N * (p.w16 ? 2 : 4);
  if (bytes < min_parallel_bytes()) {
    for (int64_t i = 0; i < n_chunks; ++i) body(i);
  } else {
    SpinPool::get().run(n_chunks, body);
  }
}

ffi::Error fg_impl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto bad = [](const std::string& why) { return ffi::Error::InvalidArgument("llmeq_float_gemv: " + why); };
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2) return bad("x and y must be 2-D");
  if (wd.size() != 2 && wd.size() != 3) return bad("w must be (K, N) or a stack (L, K, N)");
  const size_t o = wd.size() - 2;
  FG p{};
  p.L = o ? wd[0] : 1;
  p.M = xd[0];
  p.K = xd[1];
  p.N = wd[o + 1];
  if (wd[o] != p.K) return bad("w's contraction size must be x's feature count");
  if (yd[0] != p.M || yd[1] != p.N) return bad("y must be (M, N)");
  if (w.element_type() != ffi::DataType::F32 && w.element_type() != ffi::DataType::BF16)
    return bad("w must be float32 or bfloat16");
  if (layer.element_count() != 1) return bad("layer must be one int32");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= p.L) return bad("layer index outside the stack");
  const int64_t offset = l * p.K * p.N;
  if (w.element_type() == ffi::DataType::F32) p.w32 = static_cast<const float*>(w.untyped_data()) + offset;
  else p.w16 = static_cast<const uint16_t*>(w.untyped_data()) + offset;
  p.x = x.typed_data();
  p.y = y->typed_data();
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  fg_run(p);
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------- decode attention
//
// Grouped-query attention for a few query positions over a float KV cache, the
// math of models.layers.dot_product_attention in one call (XLA ran it as two small
// dot fusions plus softmax ops, ~100 us per layer of mostly launch overhead):
//   s = mask ? q . k / sqrt(D) : masked;  p = softmax(s);  out = sum_s p_s v_s.

struct AT {
  int64_t B, T, H, KV, S, D;
  const float *q, *k, *v;  // q [B, T, H, D]; k, v [B, KV, S, D]
  const bool* mask;        // [B, T, S]
  float* out;              // [B, T, H, D]
  float masked, inv_sqrt_d;
};

float at_dot_scalar(const float* a, const float* b, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

#if LLMEQ_X86
AVX2 float at_dot_avx2(const float* a, const float* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

AVX2 void at_axpy_avx2(float a, const float* x, float* y, int64_t d) {
  int64_t i = 0;
  __m256 av = _mm256_set1_ps(a);
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < d; ++i) y[i] += a * x[i];
}
#endif

// One (batch row, KV head): every query position and every query head of its group.
void at_group(const AT& p, int64_t b, int64_t kvh, bool simd) {
  const int64_t G = p.H / p.KV;
  std::vector<float> sc(p.S);
  const float* kb = p.k + (b * p.KV + kvh) * p.S * p.D;
  const float* vb = p.v + (b * p.KV + kvh) * p.S * p.D;
  for (int64_t t = 0; t < p.T; ++t) {
    const bool* mk = p.mask + (b * p.T + t) * p.S;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = kvh * G + g;
      const float* qv = p.q + ((b * p.T + t) * p.H + h) * p.D;
      float* o = p.out + ((b * p.T + t) * p.H + h) * p.D;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < p.S; ++s) {
        float d;
#if LLMEQ_X86
        if (simd) d = mk[s] ? at_dot_avx2(qv, kb + s * p.D, p.D) * p.inv_sqrt_d : p.masked;
        else
#endif
          d = mk[s] ? at_dot_scalar(qv, kb + s * p.D, p.D) * p.inv_sqrt_d : p.masked;
        sc[s] = d;
        mx = std::max(mx, d);
      }
      float sum = 0.f;
      for (int64_t s = 0; s < p.S; ++s) {
        sc[s] = std::exp(sc[s] - mx);
        sum += sc[s];
      }
      const float inv = 1.f / sum;
      std::fill(o, o + p.D, 0.f);
      for (int64_t s = 0; s < p.S; ++s) {
        const float w = sc[s] * inv;
        if (w == 0.f) continue;  // masked slots (exp underflows to exactly 0) add nothing
#if LLMEQ_X86
        if (simd) {
          at_axpy_avx2(w, vb + s * p.D, o, p.D);
          continue;
        }
#endif
        for (int64_t i = 0; i < p.D; ++i) o[i] += w * vb[s * p.D + i];
      }
    }
  }
}

// ----------------------------------------------------------------------------- prefill attention
//
// The same math for many query positions (prefill, perplexity windows): blocked
// attention with an online softmax (FlashAttention's recurrence). One task = one
// batch row, one KV head, kFlashQ query positions x the G query heads that share
// the KV head (R = kFlashQ * G rows). For each block of kFlashS keys that any row
// may see: scores = Q K^T (a 4 x 16 register-blocked kernel over D), the row max
// and sum updated online, O += P V (4 x 16 kernel over the keys). Keys no row of
// the task may see (the causal future) are never touched, so a causal window costs
// half of a full one, and no [T, S] score matrix is ever written out: XLA's
// version materialized and copied it (~25 % of SmolLM2's 512-token forward).

constexpr int64_t kFlashQ = 64;
constexpr int64_t kFlashS = 64;
constexpr int64_t kFlashMinT = 16;  // fewer query positions: at_group (decode)

#if LLMEQ_X86
// exp for AVX2: Cephes' expf (range reduction by ln 2 in two parts, degree-6
// polynomial), |relative error| < 2e-7 on [-87.3, 88.3]; below -87.3 (and -inf)
// gives exactly 0, like the reference's exp(masked - max).
namespace expf_c {  // exp256's and exp512's constants
constexpr float kLo = -87.3365447504f, kHi = 88.3762626647949f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = kLn2Hi + kLn2Lo
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace expf_c

AVX2 inline __m256 exp256(__m256 x) {
  using namespace expf_c;
  const __m256 lo = _mm256_set1_ps(kLo);
  x = _mm256_min_ps(x, _mm256_set1_ps(kHi));
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// acc[RB rows][16 cols] = a[RB][K] (row stride lda) . b[K][16] (row stride ldb), added to c (stride ldc).
template <int RB>
AVX2 inline void flash_tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float* c, int64_t ldc,
                            bool accumulate) {
  __m256 acc[RB][2];
  for (int i = 0; i < RB; ++i) {
    acc[i][0] = accumulate ? _mm256_loadu_ps(c + i * ldc) : _mm256_setzero_ps();
    acc[i][1] = accumulate ? _mm256_loadu_ps(c + i * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
    for (int i = 0; i < RB; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i * lda + k);
      acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < RB; ++i) {
    _mm256_storeu_ps(c + i * ldc, acc[i][0]);
    _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
  }
}

// AVX-512 version of flash_tile: RB rows x (16 * NB) columns, one zmm per 16 columns.
#define AVX512 __attribute__((target("avx512f,avx2,fma")))

// exp256's steps on 16 lanes: every lane's result is exp256's, bit for bit.
AVX512 inline __m512 exp512(__m512 x) {
  using namespace expf_c;
  const __m512 lo = _mm512_set1_ps(kLo);
  x = _mm512_min_ps(x, _mm512_set1_ps(kHi));
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

// row[j] = exp(row[j] - m) for j < n (a multiple of 16); returns their sum, added up in the
// same order as the 8-lane loop of flash_task (so both give the same bits).
AVX512 __attribute__((noinline)) float exp_row512(float* row, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + j), mv));
    _mm512_storeu_ps(row + j, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  return hsum(acc);
}
template <int RB, int NB>
AVX512 __attribute__((noinline)) void flash_tile512(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K,
                                                    float* c, int64_t ldc, bool accumulate) {
  __m512 acc[RB][NB];
  for (int i = 0; i < RB; ++i)
    for (int u = 0; u < NB; ++u) acc[i][u] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16 * u) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 bv[NB];
    for (int u = 0; u < NB; ++u) bv[u] = _mm512_loadu_ps(b + k * ldb + 16 * u);
    for (int i = 0; i < RB; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + k]);
      for (int u = 0; u < NB; ++u) acc[i][u] = _mm512_fmadd_ps(av, bv[u], acc[i][u]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int u = 0; u < NB; ++u) _mm512_storeu_ps(c + i * ldc + 16 * u, acc[i][u]);
}

AVX512 __attribute__((noinline)) void flash_gemm512(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t R,
                                                    int64_t K, int64_t N, float* c, int64_t ldc, bool accumulate) {
  int64_t n0 = 0;
  for (; n0 + 64 <= N; n0 += 64) {
    int64_t r = 0;
    for (; r + 6 <= R; r += 6) flash_tile512<6, 4>(a + r * lda, lda, b + n0, ldb, K, c + r * ldc + n0, ldc, accumulate);
    for (; r < R; ++r) flash_tile512<1, 4>(a + r * lda, lda, b + n0, ldb, K, c + r * ldc + n0, ldc, accumulate);
  }
  for (; n0 < N; n0 += 16) {
    int64_t r = 0;
    for (; r + 8 <= R; r += 8) flash_tile512<8, 1>(a + r * lda, lda, b + n0, ldb, K, c + r * ldc + n0, ldc, accumulate);
    for (; r < R; ++r) flash_tile512<1, 1>(a + r * lda, lda, b + n0, ldb, K, c + r * ldc + n0, ldc, accumulate);
  }
}

// ----------------------------------------------------------------------------- float GEMM on packed panels
//
// y[M, N] = x[M, K] @ W for a float kernel packed once (decode_layout.for_prefill) into
// P = ceil(N / 32) column panels, [P, K, 32], the last one zero-padded. XLA's dot ran
// SmolLM2's prefill shapes at 255-290 GFLOP/s here and torch's at 300-320; the panels
// make every k's 32 weights one 128-byte line, so a 12 x 32 tile (24 accumulators, two
// weight loads and twelve broadcasts per k) runs at the FMA ports' pace. The whole K
// runs in one pass while a panel stays in L2 (K <= kPanelMaxK); a longer K is split in
// even blocks that accumulate into y.
//
// A SwiGLU MLP's gate/up kernel is packed with each panel holding 16 gate columns and the
// 16 matching up columns, and the tile stores silu(gate) * up: the [M, 2I] product and the
// elementwise pass over it (~0.3 ms of a 20 ms SmolLM2 layer) never exist.
constexpr int64_t kPanelMaxK = 2048;

// silu(g) * u = g / (1 + exp(-g)) * u, 16 lanes (exp256, the attention's, by halves).
AVX512 inline __m512 swiglu512(__m512 g, __m512 u) {
  const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), g);
  const __m256 lo = exp256(_mm512_castps512_ps256(neg));
  const __m256 hi = exp256(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(neg), 1)));
  const __m512 e = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

// What a panel product pulls into L2 while its tiles run: the weights of the next slice, `rows`
// rows `stride` bytes apart, a line at each row's start and, when `second` is not 0, another
// `second` bytes on. In a model every slice comes from
// DRAM, and the hardware prefetchers alone left +8 % on gate/up (cold float weights) against the
// same call with the weights in cache; the rows of an int8 slice are 32 bytes of a kernel row each,
// a stride the prefetchers do not follow.
struct NextSlice {
  const char* base = nullptr;
  int64_t stride = 0, rows = 0, second = 0;
};

// One 32-column panel's product for R rows over kc positions of K: acc = (in, when given, with
// row stride ld_in) + x[R, 0:kc] @ panel[0:kc, 32]; stored as 32 columns, or with SWIGLU (the
// panel's columns are 16 gate then the 16 matching up columns) as silu(gate) * up, 16 columns.
// While it runs it also prefetches `pf_k` <= kc rows of a NextSlice (from `pf`) into L2.
template <int R, bool SWIGLU>
AVX512 __attribute__((noinline)) void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t kc,
                                                 const float* in, int64_t ld_in, float* out, int64_t ld_out,
                                                 const char* pf, int64_t pf_stride, int64_t pf_second, int64_t pf_k) {
  __m512 c0[R], c1[R];
  for (int i = 0; i < R; ++i) {
    c0[i] = in ? _mm512_loadu_ps(in + i * ld_in) : _mm512_setzero_ps();
    c1[i] = in ? _mm512_loadu_ps(in + i * ld_in + 16) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (k < pf_k) {
      _mm_prefetch(pf + k * pf_stride, _MM_HINT_T1);
      if (pf_second) _mm_prefetch(pf + k * pf_stride + pf_second, _MM_HINT_T1);
    }
    const __m512 b0 = _mm512_loadu_ps(panel + k * kPanelCols), b1 = _mm512_loadu_ps(panel + k * kPanelCols + 16);
    for (int i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
      c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    if (SWIGLU) {
      _mm512_storeu_ps(out + i * ld_out, swiglu512(c0[i], c1[i]));
    } else {
      _mm512_storeu_ps(out + i * ld_out, c0[i]);
      _mm512_storeu_ps(out + i * ld_out + 16, c1[i]);
    }
  }
}

// Rows [0, R) of one panel's product over K positions [k0, k0 + kc) (see panel_tile; `in` and
// `out` are row 0's, row strides ld_in / ld_out). The tiles share the prefetch of this K block's
// part of `next` (its rows in proportion to [k0, k0 + kc) of K).
template <bool SWIGLU>
AVX512 void panel_rows(const float* x, int64_t K, int64_t R, const float* panel, int64_t k0, int64_t kc,
                       const float* in, int64_t ld_in, float* out, int64_t ld_out, const NextSlice& next) {
  const int64_t tiles = cdiv(R, kPanelTileRows);
  const int64_t pf0 = next.rows * k0 / K, pf1 = next.rows * (k0 + kc) / K, per_tile = cdiv(pf1 - pf0, tiles);
  auto pf = [&](int64_t t, const char** at) {
    const int64_t from = std::min(pf1, pf0 + t * per_tile);
    *at = next.base ? next.base + from * next.stride : nullptr;
    return next.base ? std::min({per_tile, pf1 - from, kc}) : int64_t(0);
  };
  const float* w = panel + k0 * kPanelCols;
  const char* at;
  int64_t r = 0, t = 0;
  for (; r + kPanelTileRows <= R; r += kPanelTileRows, ++t) {
    const int64_t n = pf(t, &at);
    panel_tile<kPanelTileRows, SWIGLU>(x + r * K + k0, K, w, kc, in ? in + r * ld_in : nullptr, ld_in,
                                       out + r * ld_out, ld_out, at, next.stride, next.second, n);
  }
  const int64_t n = pf(t, &at);
  const float* xr = x + r * K + k0;
  const float* ir = in ? in + r * ld_in : nullptr;
  float* orow = out + r * ld_out;
  switch (R - r) {
#define LLMEQ_PANEL_REST(m) \
  case m:                   \
    panel_tile<m, SWIGLU>(xr, K, w, kc, ir, ld_in, orow, ld_out, at, next.stride, next.second, n); \
    break;
    LLMEQ_PANEL_REST(1) LLMEQ_PANEL_REST(2) LLMEQ_PANEL_REST(3) LLMEQ_PANEL_REST(4) LLMEQ_PANEL_REST(5)
    LLMEQ_PANEL_REST(6) LLMEQ_PANEL_REST(7) LLMEQ_PANEL_REST(8) LLMEQ_PANEL_REST(9) LLMEQ_PANEL_REST(10)
    LLMEQ_PANEL_REST(11)
#undef LLMEQ_PANEL_REST
    default:
      break;
  }
}

// Rows [r0, r1) x one [K, 32] panel, output columns p * width.. of y (N columns; `width` 32, or
// 16 with SWIGLU). A K split in blocks accumulates in y (or, with SWIGLU, in a scratch tile
// whose last block goes through the activation); a partial last panel goes through a scratch
// output. `next` is prefetched meanwhile.
template <bool SWIGLU>
AVX512 void panel_product(const float* x, const float* panel, const NextSlice& next, float* y, int64_t K, int64_t N,
                          int64_t r0, int64_t r1, int64_t p) {
  constexpr int64_t width = SWIGLU ? kPanelCols / 2 : kPanelCols;
  const int64_t R = r1 - r0, cols = std::min(width, N - p * width);
  const int64_t blocks = cdiv(K, kPanelMaxK), kc = cdiv(K, blocks);
  const float* xr = x + r0 * K;
  thread_local std::vector<float> partial, scratch;
  const bool whole = cols == width;
  if (!whole) scratch.resize(R * width);
  if (SWIGLU && blocks > 1) partial.resize(R * kPanelCols);
  float* out = whole ? y + r0 * N + p * width : scratch.data();
  const int64_t ld = whole ? N : width;
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t n = std::min(kc, K - k0);
    if (!SWIGLU) {
      panel_rows<false>(xr, K, R, panel, k0, n, k0 > 0 ? out : nullptr, ld, out, ld, next);
    } else if (k0 + n < K) {  // not the last block: the 32 raw sums
      panel_rows<false>(xr, K, R, panel, k0, n, k0 > 0 ? partial.data() : nullptr, kPanelCols, partial.data(),
                        kPanelCols, next);
    } else {
      panel_rows<true>(xr, K, R, panel, k0, n, k0 > 0 ? partial.data() : nullptr, kPanelCols, out, ld, next);
    }
  }
  if (!whole)
    for (int64_t r = 0; r < R; ++r) std::memcpy(y + (r0 + r) * N + p * width, scratch.data() + r * width, sizeof(float) * cols);
}

// One task of a packed float product: rows [r0, r1) x panel p of P, the next panel prefetched.
template <bool SWIGLU>
AVX512 void panel_task(const float* x, const float* panels, float* y, int64_t K, int64_t N, int64_t P, int64_t r0,
                       int64_t r1, int64_t p) {
  const float* panel = panels + p * K * kPanelCols;
  NextSlice next;
  if (p + 1 < P) next = {reinterpret_cast<const char*>(panel + K * kPanelCols), kPanelCols * sizeof(float), K, 64};
  panel_product<SWIGLU>(x, panel, next, y, K, N, r0, r1, p);
}

// Weight-only products of many rows (prefill) on AVX-512: a task dequantizes one 32-column
// slice of W, (q - zp) * scale, into a float panel in its thread's scratch (L2), then runs the
// float panel tiles on it. XLA instead dequantized the whole kernel to memory and then ran its
// float GEMM: rtn-w8 prefill was 0.77x fp32's. kn layout here; nk (the tied head) below.
//
// kn: panel pidx's 32 columns of W, two halves of 16: columns pidx * 32 + 16 h.., or with swiglu
// the gate's columns pidx * 16.. and the matching up columns F + pidx * 16.. (F = N / 2, gate
// first). Columns past a half's end are zero.
AVX512 void wo_dequant_panel(const WO& p, int64_t pidx, float* panel) {
  int64_t c0[2], cols[2];
  for (int h = 0; h < 2; ++h) {
    c0[h] = p.swiglu ? h * (p.N / 2) + pidx * 16 : pidx * kPanelCols + 16 * h;
    cols[h] = std::clamp<int64_t>((p.swiglu ? (h + 1) * (p.N / 2) : p.N) - c0[h], 0, 16);
  }
  const bool partial = cols[0] < 16 || cols[1] < 16;
  float s[kPanelCols] = {}, z[kPanelCols] = {};
  uint8_t tail[kPanelCols] = {};  // a partial slice's codes, zeros past each half's end
  // Group by group, the scales in registers: a k / gs per k cost as much as the conversions.
  for (int64_t g = 0; g < p.G; ++g) {
    for (int h = 0; h < 2; ++h)
      for (int64_t j = 0; j < cols[h]; ++j) {
        s[16 * h + j] = p.scale[g * p.N + c0[h] + j];
        z[16 * h + j] = p.zp ? p.zp[g * p.N + c0[h] + j] : 0.f;
      }
    const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
    const __m512 z0 = _mm512_loadu_ps(z), z1 = _mm512_loadu_ps(z + 16);
    for (int64_t k = g * p.gs, k1 = std::min(p.K, k + p.gs); k < k1; ++k) {
      const uint8_t* row = p.q + (p.int4 ? k / 2 : k) * p.N;
      const uint8_t *src0 = row + c0[0], *src1 = row + c0[1];
      if (partial) {
        for (int h = 0; h < 2; ++h) std::memcpy(tail + 16 * h, row + c0[h], cols[h]);
        src0 = tail;
        src1 = tail + 16;
      }
      __m512i v0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src0)));
      __m512i v1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src1)));
      if (p.int4) {  // the even k's code is the low nibble, the odd k's the high one (sign-extended)
        const int up = (k & 1) ? 24 : 28;
        v0 = _mm512_srai_epi32(_mm512_slli_epi32(v0, up), 28);
        v1 = _mm512_srai_epi32(_mm512_slli_epi32(v1, up), 28);
      }
      _mm512_storeu_ps(panel + k * kPanelCols, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v0), z0), s0));
      _mm512_storeu_ps(panel + k * kPanelCols + 16, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v1), z1), s1));
    }
  }
}

// 16 x 16 floats: dst[c * ldd + r] = src[r * lds + c]. Pairs, then quads of rows are
// interleaved within each 128-bit lane; the last step gathers each column's four lanes.
AVX512 inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {  // lane L: (r_i[4L], r_i+1[4L], r_i[4L+1], r_i+1[4L+1]), then +2, +3
    u[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    u[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + j], lane L: rows i..i+3 of column 4L + j
    const __m512d a = _mm512_castps_pd(u[i]), b = _mm512_castps_pd(u[i + 1]);
    const __m512d c = _mm512_castps_pd(u[i + 2]), d = _mm512_castps_pd(u[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 lo01 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44), lo23 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
    const __m512 hi01 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE), hi23 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
    _mm512_storeu_ps(dst + j * ldd, _mm512_shuffle_f32x4(lo01, lo23, 0x88));
    _mm512_storeu_ps(dst + (4 + j) * ldd, _mm512_shuffle_f32x4(lo01, lo23, 0xDD));
    _mm512_storeu_ps(dst + (8 + j) * ldd, _mm512_shuffle_f32x4(hi01, hi23, 0x88));
    _mm512_storeu_ps(dst + (12 + j) * ldd, _mm512_shuffle_f32x4(hi01, hi23, 0xDD));
  }
}

// One (out, in) row n of W dequantized, (q - zp) * scale per group, into row[0, K).
AVX512 void wo_dequant_row_nk(const WO& p, int64_t n, float* row) {
  const uint8_t* q = p.q + n * p.Kb;
  // int4: each byte twice (low nibble for the even k, high for the odd one), shifted so the
  // nibble's sign bit is bit 31, then shifted back arithmetically.
  const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i up = _mm512_setr_epi32(28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24);
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t k1 = std::min(p.K, (g + 1) * p.gs);
    const float s = p.scale[n * p.G + g], z = p.zp ? p.zp[n * p.G + g] : 0.f;
    const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
    int64_t k = g * p.gs;
    // int4 vectors start on an even k (a byte boundary): groups are even unless there is one group.
    for (; k + 16 <= k1 && !(p.int4 && (k & 1)); k += 16) {
      __m512i v;
      if (p.int4) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k / 2));
        v = _mm512_srai_epi32(_mm512_sllv_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(bytes, twice)), up), 28);
      } else {
        v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k)));
      }
      _mm512_storeu_ps(row + k, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v), vz), vs));
    }
    for (; k < k1; ++k) row[k] = (wo_weight(p, k, n) - z) * s;
  }
}

// nk layout: the 32 (out, in) rows n0.. of W dequantized one by one into rows (contiguous),
// then transposed 16 x 16 into the [K, 32] panel the tiles read. Rows past N are zero.
AVX512 void wo_dequant_panel_nk(const WO& p, int64_t n0, float* panel) {
  const int64_t cols = std::min(kPanelCols, p.N - n0), K16 = cdiv(p.K, 16) * 16;
  thread_local std::vector<float> rows;
  rows.resize(kPanelCols * K16);
  for (int64_t j = 0; j < kPanelCols; ++j) {
    float* row = rows.data() + j * K16;
    if (j < cols) wo_dequant_row_nk(p, n0 + j, row);
    std::fill(row + (j < cols ? p.K : 0), row + K16, 0.f);
  }
  for (int64_t k = 0; k < K16; k += 16)
    for (int64_t j = 0; j < kPanelCols; j += 16) transpose16(rows.data() + j * K16 + k, K16, panel + k * kPanelCols + j, kPanelCols);
}

AVX512 void wo_panel_task(const WO& p, int64_t P, int64_t pidx, int64_t r0, int64_t r1) {
  thread_local std::vector<float> panel;
  panel.resize(cdiv(p.K, 16) * 16 * kPanelCols);
  if (p.nk) wo_dequant_panel_nk(p, pidx * kPanelCols, panel.data());
  else wo_dequant_panel(p, pidx, panel.data());
  // The next slice's codes: kn, a piece of each stored kernel row (with swiglu a gate piece and the
  // up piece N / 2 bytes on); nk, 32 contiguous rows.
  NextSlice next;
  if (pidx + 1 < P) {
    const auto* q = reinterpret_cast<const char*>(p.q);
    const int64_t n1 = (pidx + 1) * kPanelCols;
    if (p.nk) next = {q + n1 * p.Kb, 64, cdiv(std::min(kPanelCols, p.N - n1) * p.Kb, 64), 0};
    else if (p.swiglu) next = {q + (pidx + 1) * kPanelCols / 2, p.N, p.Kb, p.N / 2};
    else next = {q + n1, p.N, p.Kb, 0};
  }
  if (p.swiglu) panel_product<true>(p.x, panel.data(), next, p.y, p.K, p.N / 2, r0, r1, pidx);
  else panel_product<false>(p.x, panel.data(), next, p.y, p.K, p.N, r0, r1, pidx);
}

// Row blocks of a weight-only panel product: one (each slice dequantized once, the threads
// splitting the slices) while the activations fit in L2 beside it; at 32-128 rows of SmolLM2's
// shapes that ran 2-20 % faster than two blocks (2-core Xeon), at 512 rows no different.
inline int64_t wo_row_blocks(const WO& p) {
  return p.M * p.K * int64_t(sizeof(float)) <= kPanelBlockBytes ? 1 : panel_row_blocks(p.M, p.K);
}

void wo_panel_run(const WO& p, ffi::ThreadPool* pool) {
  const int64_t P = p.swiglu ? cdiv(p.N / 2, kPanelCols / 2) : cdiv(p.N, kPanelCols);
  const int64_t blocks = wo_row_blocks(p), rows = cdiv(cdiv(p.M, blocks), kPanelTileRows) * kPanelTileRows;
  parallel_for(pool, blocks * P, [&p, P, blocks, rows](int64_t i) {
    const int64_t r0 = (i % blocks) * rows, r1 = std::min(p.M, r0 + rows);
    if (r0 < r1) wo_panel_task(p, P, i / blocks, r0, r1);
  });
}

// ---- Weight-only products of many rows on integer panels (AVX-512 VNNI)
//
// The float panels above multiply at the FMA rate, 16 multiply-adds an instruction; vpdpwssd does 32
// (pairs of int16 products summed into int32 lanes). Here x is quantized to int16 per row and per flush
// group along K exactly as the decode kernels quantize it (rm_quantize_x16: the weight's groups, or 128
// values per-channel; scale absmax / 32767, so at most 2^-16 of the group's absmax off). A 32-column slice
// of the codes is widened once per call into int16 pairs, [K/2][32] dwords holding (code at k, code at
// k + 1); a tile of 4 rows broadcasts a row's pair against the slice's two vectors of 16 columns, sums a
// group exactly in int32, then adds it times the weight scale and the activation scale in float, the zero
// points taken off with the group's activation sums. Per call, x's quantization and each slice's widening
// are once; the tile is vpdpwssd-bound with long groups (per-channel int8 ran at ~93 % of its 64 flops a
// cycle a core) and pays one convert + two float ops a group per 16 columns with short ones (g16 / g32).
//
// With int8 activations (`int_bits` 8, llama.cpp's prompt arithmetic: scale absmax / 127, so up to 2^-8 of
// the group's absmax off) the slice becomes signed byte quads, [K/4][32] dwords of the codes at k..k+3, and
// vpdpbusd sums 64 products an instruction, twice vpdpwssd's 32: x goes in unsigned, u = x + 128, and each
// group's sums start at -128 times the group's code sums of their column, which takes the offset off exactly.
constexpr int kIntPanelTileRows = 4;

struct WOI {
  const WO* p;
  const uint8_t* xq;   // [M, Kp]: int16 codes (2 bytes each), or int8 codes + 128 (1 byte each); K padded to Kp
                       // (a multiple of the values a dword holds) with zero codes
  const float* sa;     // [M, A] activation scale per flush group
  const float* xsum;   // [M, A] sum of the quantized activations of each group (times sa), with zero points
  int64_t Kp, F, A;
  int bytes;           // bytes an activation code: 2 (int16 pairs) or 1 (uint8 quads)
};

// The activations' flush groups: the decode kernels' (rm_setup), so that a prompt's products and the decode
// steps' quantize x alike -- the weight's groups, or 128 values for one group a row.
inline int64_t wo_int_flush(const WO& p) { return p.G > 1 ? p.gs : std::min<int64_t>(p.K, 128); }

// Whether a weight-only product runs on the integer panels: groups that fill whole dwords (pairs or quads, or
// one flush group in all), and int32 sums that cannot overflow -- a lane sums a whole group of one column,
// at most F * 32767 * 128 for int8 codes (F <= 256), F * 32767 * 8 for int4 ones (F <= 4096); with int8 x
// at most F * 255 * 128 plus the offset's F * 128 * 128 (F <= 4096).
bool wo_int_panels_ok(const WO& p) {
  const int64_t F = wo_int_flush(p);
  if (p.int_bits == 8) return (F % 4 == 0 || F >= p.K) && F <= 4096;
  return (F % 2 == 0 || F >= p.K) && F <= (p.int4 ? 4096 : 256);
}

// (a, b) int32 lanes holding int16 values as the dwords (a, b): vpdpwssd's pair of a lane.
VNNI512 inline __m512i int16_pairs(__m512i a, __m512i b) {
  return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(b, 16));
}

// kn: slice pidx's codes, a pair of kernel rows at a time, 16 columns a vector (see wo_int_panel).
VNNI512 void wo_int_panel_kn(const WO& p, int64_t Kp, const int64_t* c0, const int64_t* cols, int32_t* panel) {
  uint8_t tail[16];
  for (int64_t k = 0; k < Kp; k += 2) {
    if (k >= p.K) {  // the padding up to a whole quad
      std::memset(panel + (k / 2) * kPanelCols, 0, kPanelCols * sizeof(int32_t));
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      auto bytes = [&](int64_t kk) -> const uint8_t* {  // 16 codes of row kk (int4: the byte of kk and kk + 1)
        const uint8_t* src = p.q + (p.int4 ? kk / 2 : kk) * p.N + c0[h];
        if (cols[h] == 16) return src;
        std::memset(tail, 0, 16);
        std::memcpy(tail, src, cols[h]);
        return tail;
      };
      __m512i a, b;
      if (p.int4) {  // k even: its code is the low nibble, k + 1's the high one
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes(k))));
        a = _mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28);
        b = k + 1 < p.K ? _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 28) : _mm512_setzero_si512();
      } else {
        a = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes(k))));
        b = k + 1 < p.K ? _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes(k + 1))))
                        : _mm512_setzero_si512();
      }
      _mm512_storeu_si512(panel + (k / 2) * kPanelCols + 16 * h, int16_pairs(a, b));
    }
  }
}

// nk: the slice's 32 (out, in) rows (from c0[0]) widened into pairs row by row, 16 pairs a vector, then
// transposed 16 x 16 into the panel (transpose16 only moves bits: the dwords pass through it as they
// are). Rows past N and pairs past K are zero; the panel holds `pairs` rows, a multiple of 16.
VNNI512 void wo_int_panel_nk(const WO& p, int64_t pairs, int64_t cols, int64_t n0, int32_t* panel) {
  thread_local std::vector<int32_t> rows;
  rows.assign(kPanelCols * pairs, 0);
  for (int64_t j = 0; j < cols; ++j) {
    const uint8_t* q = p.q + (n0 + j) * p.Kb;
    int32_t* row = rows.data() + j * pairs;
    int64_t t = 0;
    for (; 2 * (t + 16) <= p.K; t += 16) {  // 16 whole pairs
      __m512i v;
      if (p.int4) {  // one byte a pair: value 2t in its low nibble, 2t + 1 in its high one
        const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + t)));
        v = int16_pairs(_mm512_srai_epi32(_mm512_slli_epi32(b, 28), 28), _mm512_srai_epi32(_mm512_slli_epi32(b, 24), 28));
      } else {  // two bytes a pair: widened to int16 they are the pair's dword already
        v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * t)));
      }
      _mm512_storeu_si512(row + t, v);
    }
    for (; 2 * t < p.K; ++t) {
      const int32_t lo = static_cast<int32_t>(wo_weight(p, 2 * t, n0 + j));
      const int32_t hi = 2 * t + 1 < p.K ? static_cast<int32_t>(wo_weight(p, 2 * t + 1, n0 + j)) : 0;
      row[t] = static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
    }
  }
  for (int64_t t = 0; t < pairs; t += 16)
    for (int64_t j = 0; j < kPanelCols; j += 16)
      transpose16(reinterpret_cast<const float*>(rows.data() + j * pairs + t), pairs,
                  reinterpret_cast<float*>(panel + t * kPanelCols + j), kPanelCols);
}

// Slice pidx's codes as int16 pairs, [pairs][32] dwords (code at 2t, code at 2t + 1) per column; columns
// past the kernel's end and pairs past K zero; with swiglu (kn) its 16 gate columns then the 16 matching
// up columns. c0 / cols: where each half's columns start and how many exist.
VNNI512 void wo_int_panel(const WO& p, int64_t pidx, int64_t Kp, int64_t pairs, int32_t* panel, int64_t* c0,
                          int64_t* cols) {
  for (int h = 0; h < 2; ++h) {
    c0[h] = p.swiglu ? h * (p.N / 2) + pidx * 16 : pidx * kPanelCols + 16 * h;
    cols[h] = std::clamp<int64_t>((p.swiglu ? (h + 1) * (p.N / 2) : p.N) - c0[h], 0, 16);
  }
  if (p.nk) wo_int_panel_nk(p, pairs, cols[0] + cols[1], c0[0], panel);
  else wo_int_panel_kn(p, Kp, c0, cols, panel);
}

// The pair panel's first `quads` * 2 rows as byte quads, in place: quad row t (codes at 4t .. 4t + 3) from pair
// rows 2t and 2t + 1 (their int16 codes fit a byte); `corr` [A][32] gets each flush group's column sums of the
// codes times -128, where the tile's sums of a group start (they take off the activations' offset of 128).
VNNI512 void wo_int_panel_quads(int32_t* panel, int64_t quads, int64_t F, int64_t A, int32_t* corr) {
  auto low_bytes = [](const int32_t* pairs) VNNI512 {  // each dword's two int16 codes -> its low two bytes
    const __m512i p = _mm512_loadu_si512(pairs);
    return _mm512_or_si512(_mm512_and_si512(p, _mm512_set1_epi32(0xFF)),
                           _mm512_and_si512(_mm512_srli_epi32(p, 8), _mm512_set1_epi32(0xFF00)));
  };
  for (int64_t t = 0; t < quads; ++t)
    for (int64_t j = 0; j < kPanelCols; j += 16) {
      const __m512i lo = low_bytes(panel + 2 * t * kPanelCols + j);
      const __m512i hi = low_bytes(panel + (2 * t + 1) * kPanelCols + j);
      _mm512_storeu_si512(panel + t * kPanelCols + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t a = 0; a < A; ++a) {
    const int64_t t1 = a + 1 == A ? quads : std::min(quads, (a + 1) * F / 4);  // (one group of K % 4 != 0 values)
    for (int64_t j = 0; j < kPanelCols; j += 16) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t t = a * F / 4; t < t1; ++t) sum = dpbusd(sum, ones, _mm512_loadu_si512(panel + t * kPanelCols + j));
      _mm512_storeu_si512(corr + a * kPanelCols + j, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
    }
  }
}

// Rows [0, R) of xq (row stride Kp) times one integer panel into y (row stride ldy; 32 columns, or 16 with
// SWIGLU), `cols` of them stored. U8: uint8 activations on a quad panel, the sums started at corr (see above).
template <int R, bool SWIGLU, bool U8>
VNNI512 __attribute__((noinline)) void wo_int_tile(const WOI& c, const int32_t* panel, const int32_t* corr,
                                                    const float* s, const float* sz, int64_t m0, float* y, int64_t ldy,
                                                    int cols) {
  constexpr int64_t per = U8 ? 4 : 2;  // values a dword
  const WO& p = *c.p;
  __m512 t0[R], t1[R];
  for (int i = 0; i < R; ++i) t0[i] = t1[i] = _mm512_setzero_ps();
  const uint8_t* x = c.xq + m0 * c.Kp * c.bytes;
  for (int64_t a = 0; a < c.A; ++a) {
    const int64_t k0 = a * c.F, k1 = std::min(c.Kp, k0 + c.F);
    __m512i a0[R], a1[R];
    for (int i = 0; i < R; ++i) {
      a0[i] = U8 ? _mm512_loadu_si512(corr + a * kPanelCols) : _mm512_setzero_si512();
      a1[i] = U8 ? _mm512_loadu_si512(corr + a * kPanelCols + 16) : _mm512_setzero_si512();
    }
    for (int64_t k = k0; k < k1; k += per) {
      const __m512i w0 = _mm512_loadu_si512(panel + (k / per) * kPanelCols);
      const __m512i w1 = _mm512_loadu_si512(panel + (k / per) * kPanelCols + 16);
      for (int i = 0; i < R; ++i) {
        int32_t word;
        std::memcpy(&word, x + (i * c.Kp + k) * c.bytes, 4);
        const __m512i xb = _mm512_set1_epi32(word);
        if constexpr (U8) {
          a0[i] = dpbusd(a0[i], xb, w0);
          a1[i] = dpbusd(a1[i], xb, w1);
        } else {
          a0[i] = _mm512_dpwssd_epi32(a0[i], w0, xb);
          a1[i] = _mm512_dpwssd_epi32(a1[i], w1, xb);
        }
      }
    }
    const int64_t g = p.G > 1 ? a : 0;  // flush groups are the weight's groups, or all in its one group
    const __m512 s0 = _mm512_loadu_ps(s + g * kPanelCols), s1 = _mm512_loadu_ps(s + g * kPanelCols + 16);
    for (int i = 0; i < R; ++i) {
      const __m512 f = _mm512_set1_ps(c.sa[(m0 + i) * c.A + a]);
      t0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[i]), _mm512_mul_ps(s0, f), t0[i]);
      t1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[i]), _mm512_mul_ps(s1, f), t1[i]);
    }
    if (sz) {
      const __m512 z0 = _mm512_loadu_ps(sz + g * kPanelCols), z1 = _mm512_loadu_ps(sz + g * kPanelCols + 16);
      for (int i = 0; i < R; ++i) {
        const __m512 xs = _mm512_set1_ps(c.xsum[(m0 + i) * c.A + a]);
        t0[i] = _mm512_fnmadd_ps(z0, xs, t0[i]);
        t1[i] = _mm512_fnmadd_ps(z1, xs, t1[i]);
      }
    }
  }
  const __mmask16 keep = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  for (int i = 0; i < R; ++i) {
    if constexpr (SWIGLU) {
      _mm512_mask_storeu_ps(y + i * ldy, keep, swiglu512(t0[i], t1[i]));
    } else {
      _mm512_mask_storeu_ps(y + i * ldy, keep, t0[i]);
      if (cols > 16) _mm512_mask_storeu_ps(y + i * ldy + 16, __mmask16((1u << (cols - 16)) - 1), t1[i]);
    }
  }
}

template <bool SWIGLU, bool U8>
VNNI512 void wo_int_rows(const WOI& c, const int32_t* panel, const int32_t* corr, const float* s, const float* sz,
                         int64_t r0, int64_t r1, float* y, int64_t ldy, int cols) {
  int64_t r = r0;
  for (; r + kIntPanelTileRows <= r1; r += kIntPanelTileRows)
    wo_int_tile<kIntPanelTileRows, SWIGLU, U8>(c, panel, corr, s, sz, r, y + r * ldy, ldy, cols);
  switch (r1 - r) {
    case 3: wo_int_tile<3, SWIGLU, U8>(c, panel, corr, s, sz, r, y + r * ldy, ldy, cols); break;
    case 2: wo_int_tile<2, SWIGLU, U8>(c, panel, corr, s, sz, r, y + r * ldy, ldy, cols); break;
    case 1: wo_int_tile<1, SWIGLU, U8>(c, panel, corr, s, sz, r, y + r * ldy, ldy, cols); break;
    default: break;
  }
}

// One task: rows [r0, r1) times slice pidx.
VNNI512 void wo_int_task(const WOI& c, int64_t pidx, int64_t r0, int64_t r1) {
  const WO& p = *c.p;
  thread_local std::vector<int32_t> panel, corr;
  thread_local std::vector<float> s, sz;
  const int64_t pairs = cdiv(c.Kp / 2, 16) * 16;  // nk transposes 16 pairs at a time (c.Kp: even)
  panel.resize(pairs * kPanelCols);
  s.assign(p.G * kPanelCols, 0.f);
  if (p.zp) sz.assign(p.G * kPanelCols, 0.f);
  int64_t c0[2], cols[2];
  wo_int_panel(p, pidx, c.Kp, pairs, panel.data(), c0, cols);
  const bool u8 = c.bytes == 1;
  if (u8) {
    corr.resize(c.A * kPanelCols);
    wo_int_panel_quads(panel.data(), c.Kp / 4, c.F, c.A, corr.data());
  }
  for (int64_t g = 0; g < p.G; ++g)
    for (int h = 0; h < 2; ++h)
      for (int64_t j = 0; j < cols[h]; ++j) {
        const float sc = p.scale[sidx(p, g, c0[h] + j)];
        s[g * kPanelCols + 16 * h + j] = sc;
        if (p.zp) sz[g * kPanelCols + 16 * h + j] = sc * p.zp[sidx(p, g, c0[h] + j)];
      }
  const float* zs = p.zp ? sz.data() : nullptr;
  const int32_t* cs = u8 ? corr.data() : nullptr;
  float* y = p.y + pidx * (p.swiglu ? kPanelCols / 2 : kPanelCols);
  const int64_t ldy = p.swiglu ? p.N / 2 : p.N;
  const int n = static_cast<int>(p.swiglu ? cols[0] : cols[0] + cols[1]);
  if (p.swiglu && u8) wo_int_rows<true, true>(c, panel.data(), cs, s.data(), zs, r0, r1, y, ldy, n);
  else if (p.swiglu) wo_int_rows<true, false>(c, panel.data(), cs, s.data(), zs, r0, r1, y, ldy, n);
  else if (u8) wo_int_rows<false, true>(c, panel.data(), cs, s.data(), zs, r0, r1, y, ldy, n);
  else wo_int_rows<false, false>(c, panel.data(), cs, s.data(), zs, r0, r1, y, ldy, n);
}

// One flush group of n activations to int8 codes stored plus 128 (u, a byte each) with scale absmax / 127,
// which it returns, their sum (of the signed codes) in `sum`; rm_quantize_group's rules otherwise (a zero
// group: scale 0, codes 0; a non-finite one: scale NaN).
VNNI512 float wo_quantize_group_u8(const float* x, int64_t n, uint8_t* u, int32_t& sum) {
  const float amax = n % 8 == 0 ? rm_abs_max_avx2(x, n) : rm_abs_max(x, n);
  sum = 0;
  std::memset(u, 128, n);
  if (float scale; rm_degenerate_group(amax, scale)) return scale;
  const float inv = 127.f / amax;
  int64_t i = 0;
  __m512i acc = _mm512_setzero_si512();
  for (; i + 16 <= n; i += 16) {  // round to nearest even, as lrintf below
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)));
    acc = _mm512_add_epi32(acc, v);
    const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_add_epi32(v, _mm512_set1_epi32(128)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + i), bytes);
  }
  sum = _mm512_reduce_add_epi32(acc);
  for (; i < n; ++i) {
    const int32_t v = static_cast<int32_t>(std::lrintf(x[i] * inv));
    sum += v;
    u[i] = static_cast<uint8_t>(v + 128);
  }
  return amax / 127.f;
}

VNNI512 void wo_int_panel_run(const WO& p, ffi::ThreadPool* pool) {
  const bool u8 = p.int_bits == 8;
  WOI c{&p, nullptr, nullptr, nullptr, cdiv(p.K, u8 ? 4 : 2) * (u8 ? 4 : 2), wo_int_flush(p), 0, u8 ? 1 : 2};
  c.A = cdiv(p.K, c.F);
  std::vector<int16_t> x16(u8 ? 0 : p.M * c.Kp, 0);
  std::vector<uint8_t> xu(u8 ? p.M * c.Kp : 0, 128);
  std::vector<float> sa(p.M * c.A), xsum(p.zp ? p.M * c.A : 0);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t a = 0; a < c.A; ++a) {  // int16: as rm_quantize_x16 (the decode kernels' activations)
      const int64_t k0 = a * c.F, n = std::min(p.K, k0 + c.F) - k0;
      const float* xr = p.x + m * p.K + k0;
      int32_t sum;
      sa[m * c.A + a] = u8 ? wo_quantize_group_u8(xr, n, xu.data() + m * c.Kp + k0, sum)
                           : rm_quantize_group(xr, n, n % 16 == 0, false, x16.data() + m * c.Kp + k0, 0, sum);
      if (p.zp) xsum[m * c.A + a] = static_cast<float>(sum) * sa[m * c.A + a];
    }
  c.xq = u8 ? xu.data() : reinterpret_cast<const uint8_t*>(x16.data());
  c.sa = sa.data();
  c.xsum = p.zp ? xsum.data() : nullptr;
  const int64_t P = p.swiglu ? cdiv(p.N / 2, kPanelCols / 2) : cdiv(p.N, kPanelCols);
  const int64_t blocks = p.M * c.Kp * 2 <= kPanelBlockBytes ? 1 : panel_row_blocks(p.M, c.Kp / 2);
  const int64_t rows = cdiv(cdiv(p.M, blocks), kIntPanelTileRows) * kIntPanelTileRows;
  parallel_for(pool, blocks * P, [&c, P, blocks, rows](int64_t i) {
    const int64_t r0 = (i % blocks) * rows, r1 = std::min(c.p->M, r0 + rows);
    if (r0 < r1) wo_int_task(c, i / blocks, r0, r1);
  });
}

// c[R][N] (+)= a[R][K] . b[K][N], N a multiple of 16, in 4-row tiles (and a remainder).
AVX2 void flash_gemm(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t R, int64_t K, int64_t N,
                     float* c, int64_t ldc, bool accumulate) {
  if (use_avx512()) {
    flash_gemm512(a, lda, b, ldb, R, K, N, c, ldc, accumulate);
    return;
  }
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) flash_tile<4>(a + r * lda, lda, b + n0, ldb, K, c + r * ldc + n0, ldc, accumulate);
    for (; r < R; ++r) flash_tile<1>(a + r * lda, lda, b + n0, ldb, K, c + r * ldc + n0, ldc, accumulate);
  }
}

// One task: batch row b, KV head kvh, query positions [t0, t1).
AVX2 void flash_task(const AT& p, int64_t b, int64_t kvh, int64_t t0, int64_t t1) {
  const int64_t G = p.H / p.KV, D = p.D, Dp = (D + 15) / 16 * 16, nt = t1 - t0, R = nt * G;
  const float* kb = p.k + (b * p.KV + kvh) * p.S * D;
  const float* vb = p.v + (b * p.KV + kvh) * p.S * D;
  // Rows r = (t - t0) * G + g. D is padded to Dp with zeros so every tile is 16 wide.
  std::vector<float> qs(R * Dp, 0.f), o(R * Dp, 0.f), kt(Dp * kFlashS, 0.f), vs(kFlashS * Dp, 0.f),
      sc(R * kFlashS), mx(R, -std::numeric_limits<float>::infinity()), sum(R, 0.f);
  std::vector<int64_t> lo(nt), hi(nt);
  int64_t s_lo = p.S, s_hi = 0;
  const bool wide = use_avx512() && kFlashS % 16 == 0;
  for (int64_t i = 0; i < nt; ++i) {
    const bool* mk = p.mask + (b * p.T + t0 + i) * p.S;
    int64_t a = 0, e = p.S;
    while (a < p.S && !mk[a]) ++a;
    while (e > a && !mk[e - 1]) --e;
    lo[i] = a;
    hi[i] = e;
    if (a < e) s_lo = std::min(s_lo, a), s_hi = std::max(s_hi, e);
    for (int64_t g = 0; g < G; ++g) {
      const float* qv = p.q + ((b * p.T + t0 + i) * p.H + kvh * G + g) * D;
      float* dst = qs.data() + (i * G + g) * Dp;
      for (int64_t d = 0; d < D; ++d) dst[d] = qv[d] * p.inv_sqrt_d;
    }
  }
  for (int64_t s0 = s_lo; s0 < s_hi; s0 += kFlashS) {
    const int64_t sb = std::min(kFlashS, s_hi - s0);
    for (int64_t j = 0; j < sb; ++j)
      for (int64_t d = 0; d < D; ++d) kt[d * kFlashS + j] = kb[(s0 + j) * D + d];
    for (int64_t j = sb; j < kFlashS; ++j)
      for (int64_t d = 0; d < D; ++d) kt[d * kFlashS + j] = 0.f;
    flash_gemm(qs.data(), Dp, kt.data(), kFlashS, R, D, kFlashS, sc.data(), kFlashS, false);
    for (int64_t i = 0; i < nt; ++i) {
      const bool* mk = p.mask + (b * p.T + t0 + i) * p.S + s0;
      const bool whole = lo[i] <= s0 && s0 + sb <= hi[i] && std::all_of(mk, mk + sb, [](bool m) { return m; });
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        float* row = sc.data() + r * kFlashS;
        float m = -std::numeric_limits<float>::infinity();
        if (sb == kFlashS) {  // vector max (a scalar loop here was a quarter of the kernel's time)
          const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
          __m256 mx8 = ninf;
          for (int64_t j = 0; j < kFlashS; j += 8) {
            __m256 v = _mm256_loadu_ps(row + j);
            if (!whole) {  // masked keys to -inf, from 8 mask bytes
              const __m256i bits = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mk + j)));
              v = _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(bits, _mm256_setzero_si256())));
              _mm256_storeu_ps(row + j, v);
            }
            mx8 = _mm256_max_ps(mx8, v);
          }
          m = hmax(mx8);
        } else {
          for (int64_t j = 0; j < kFlashS; ++j) {
            if (j >= sb || !(whole || mk[j])) row[j] = -std::numeric_limits<float>::infinity();
            m = std::max(m, row[j]);
          }
        }
        if (m == -std::numeric_limits<float>::infinity()) {  // nothing visible in this block
          std::fill(row, row + kFlashS, 0.f);
          continue;
        }
        const float m_new = std::max(mx[r], m);
        const float alpha = std::exp(mx[r] - m_new);  // 0 for the first visible block (mx = -inf)
        mx[r] = m_new;
        float block_sum;
        if (wide) {
          block_sum = exp_row512(row, kFlashS, m_new);
        } else {
          const __m256 mv = _mm256_set1_ps(m_new);
          __m256 acc = _mm256_setzero_ps();
          for (int64_t j = 0; j < kFlashS; j += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + j), mv));
            _mm256_storeu_ps(row + j, e);
            acc = _mm256_add_ps(acc, e);
          }
          block_sum = hsum(acc);
        }
        // Product and sum rounded separately, as this kernel always did: GCC contracts
        // `sum * alpha + block_sum` to an FMA, which moved outputs by an ulp (and W8A8
        // perplexity, whose activation codes flip on such ulps, by 0.15 %).
        float kept = sum[r] * alpha;
        asm("" : "+x"(kept));
        sum[r] = kept + block_sum;
        if (alpha != 1.f) {
          float* orow = o.data() + r * Dp;
          for (int64_t d = 0; d < Dp; ++d) orow[d] *= alpha;
        }
      }
    }
    for (int64_t j = 0; j < sb; ++j) std::memcpy(vs.data() + j * Dp, vb + (s0 + j) * D, D * sizeof(float));
    flash_gemm(sc.data(), kFlashS, vs.data(), Dp, R, sb, Dp, o.data(), Dp, true);
  }
  for (int64_t i = 0; i < nt; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      float* out = p.out + ((b * p.T + t0 + i) * p.H + kvh * G + g) * D;
      if (lo[i] >= hi[i]) {  // no visible key: the reference's softmax over all-masked scores is uniform
        std::fill(out, out + D, 0.f);
        for (int64_t s = 0; s < p.S; ++s)
          for (int64_t d = 0; d < D; ++d) out[d] += vb[s * D + d];
        for (int64_t d = 0; d < D; ++d) out[d] /= static_cast<float>(p.S);
        continue;
      }
      const float inv = 1.f / sum[r];
      for (int64_t d = 0; d < D; ++d) out[d] = o[r * Dp + d] * inv;
    }
  }
}
#endif

// Portable loops for a CPU without AVX-512 (Python packs panels only where use_avx512(); this
// keeps a stray call correct).
void panel_task_scalar(const float* x, const float* panels, float* y, int64_t K, int64_t N, int64_t r0, int64_t r1,
                       int64_t p, bool swiglu) {
  const int64_t width = swiglu ? kPanelCols / 2 : kPanelCols, cols = std::min(width, N - p * width);
  const float* panel = panels + p * K * kPanelCols;
  for (int64_t r = r0; r < r1; ++r) {
    float acc[kPanelCols] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kPanelCols; ++j) acc[j] += x[r * K + k] * panel[k * kPanelCols + j];
    if (swiglu)
      for (int64_t j = 0; j < width; ++j) acc[j] = acc[j] / (1.f + std::exp(-acc[j])) * acc[width + j];
    std::memcpy(y + r * N + p * width, acc, sizeof(float) * cols);
  }
}

ffi::Error panel_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                      ffi::ResultBuffer<ffi::F32> y, int64_t swiglu) {
  auto xd = x.dimensions(), pd = panels.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("llmeq_panel_matmul: x and y must be 2-D and panels 3-D");
  const int64_t M = xd[0], K = xd[1], N = yd[1], P = pd[0], width = swiglu ? kPanelCols / 2 : kPanelCols;
  if (pd[1] != K || pd[2] != kPanelCols || yd[0] != M || P != cdiv(N, width))
    return ffi::Error::InvalidArgument(
        "llmeq_panel_matmul: panels must be [ceil(N/32), K, 32] (swiglu: [ceil(N/16), K, 32]) for x [M, K], y [M, N]");
  const float* xp = x.typed_data();
  const float* wp = panels.typed_data();
  float* yp = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {  // silu(0) * 0 = 0 too
    std::memset(yp, 0, sizeof(float) * M * N);
    return ffi::Error::Success();
  }
  const bool fast = use_avx512();
  (void)fast;  // a non-x86 build has only the portable loops
  // Rows in at least two blocks (one per thread) of at most ~1 MB of activations each, so a
  // block stays in its core's L2 while every panel streams past it; tasks panel-major, so the
  // threads work on the same panel at once and each weight byte comes from DRAM about once
  // (row blocks outermost re-read the whole kernel per block: +10 % on gate/up).
  const int64_t blocks = panel_row_blocks(M, K), rows = cdiv(cdiv(M, blocks), kPanelTileRows) * kPanelTileRows;
  auto body = [=](int64_t i) {
    const int64_t p = i / blocks, r0 = (i % blocks) * rows, r1 = std::min(M, r0 + rows);
    if (r0 >= r1) return;
#if LLMEQ_X86
    if (fast) {
      if (swiglu) panel_task<true>(xp, wp, yp, K, N, P, r0, r1, p);
      else panel_task<false>(xp, wp, yp, K, N, P, r0, r1, p);
      return;
    }
#endif
    panel_task_scalar(xp, wp, yp, K, N, r0, r1, p, swiglu != 0);
  };
  parallel_for(&pool, blocks * P, body);
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------- AVX-512 decode attention blocks
//
// One query per head over a cache, 16 slots a step, for head dims D = 16 * DC (DC = 2, 4, 6, 8: 32-128).
// Both decode kernels run on them: the float cache's (llmeq_decode_attention, its rows read in place)
// and the quantized store's (llmeq_kv_store_attention, codes decoded into a 16-row tile in L1).
// A block's 16 key rows give a query head's 16 scores with DC FMAs a row and one transposing
// reduction (hsum16x16) instead of a horizontal sum per dot, and each value row is loaded once for
// up to HB heads summed in registers. The older loops (a horizontal sum per dot, 8-lane axpys into
// memory, a scalar exp in the float kernel) spent ~200 cycles per slot and head group: the int8
// store read at ~2 GB/s on a 2-core Xeon, the float cache at 5.1 ms per SmolLM2 step at 1088 slots.

constexpr int64_t kBlock = 16;  // slots per block
// Chunks of slots a decode task reads at least (the tasks' merge costs a few microseconds each).
constexpr int64_t kMinChunk = 128;

// Slots per task of a decode kernel over `groups` (row, KV head) pairs: a multiple of kBlock, at least
// kMinChunk, and where the slots allow a task count that splits evenly between the threads (a 3-head
// batch-1 step on 2 cores: 12 tasks, not 9 that leave one thread idle for a ninth of the time).
int64_t decode_chunk(int64_t groups, int64_t slots) {
  const int64_t threads = SpinPool::get().workers() + 1, most = std::max<int64_t>(1, cdiv(slots, kMinChunk));
  int64_t chunks = std::max<int64_t>(1, std::min(most, cdiv(4 * threads, groups)));
  if ((groups * chunks) % threads && chunks < most) ++chunks;
  return std::max<int64_t>(kBlock, cdiv(cdiv(std::max<int64_t>(slots, 1), chunks), kBlock) * kBlock);
}

#if LLMEQ_X86
#define AVX512BW __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

// Lane j = the sum of the 16 lanes of v[j] (a tree of unpacks and 128-bit shuffles: 15 adds in all).
AVX512 inline __m512 hsum16x16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0 + x2, y0 + y2, x1 + x3, y1 + y3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's partial sum of v[4i .. 4i + 3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of a block for G query heads q [G, D]: sc[g * stride + j] = (q_g . rows[j]) * scale + add[g] (add
// may be null) where bit j of ok is set, else fill. rows: 16 rows, ld floats apart, all finite.
template <int DC>
AVX512 void block_scores512(const float* rows, int64_t ld, const float* q, int64_t G, float scale, const float* add,
                            __mmask16 ok, __m512 fill, float* sc, int64_t stride) {
  for (int64_t g = 0; g < G; ++g) {
    __m512 qv[DC];
    for (int c = 0; c < DC; ++c) qv[c] = _mm512_loadu_ps(q + (g * DC + c) * 16);
    __m512 acc[kBlock];
    for (int r = 0; r < kBlock; ++r) {
      const float* row = rows + r * ld;
      __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(row));
      for (int c = 1; c < DC; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(row + 16 * c), a);
      acc[r] = a;
    }
    __m512 s = _mm512_mul_ps(hsum16x16(acc), _mm512_set1_ps(scale));
    if (add) s = _mm512_add_ps(s, _mm512_set1_ps(add[g]));
    _mm512_storeu_ps(sc + g * stride, _mm512_mask_blend_ps(ok, fill, s));
  }
}

// acc[h * acc_ld ..][D] += sum_j w[h * w_ld + j] * rows[j] for HB heads (register accumulators).
template <int DC, int HB>
AVX512 void block_values512(const float* rows, int64_t ld, const float* w, int64_t w_ld, float* acc, int64_t acc_ld) {
  __m512 a[HB][DC];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < DC; ++c) a[h][c] = _mm512_loadu_ps(acc + h * acc_ld + 16 * c);
  for (int r = 0; r < kBlock; ++r) {
    __m512 wv[HB];
    for (int h = 0; h < HB; ++h) wv[h] = _mm512_set1_ps(w[h * w_ld + r]);
    for (int c = 0; c < DC; ++c) {
      const __m512 v = _mm512_loadu_ps(rows + r * ld + 16 * c);
      for (int h = 0; h < HB; ++h) a[h][c] = _mm512_fmadd_ps(wv[h], v, a[h][c]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + h * acc_ld + 16 * c, a[h][c]);
}

// block_values512 for all G heads, in register-sized groups of heads (HB * DC <= 24 accumulators).
template <int DC>
AVX512 void block_values_heads512(const float* rows, int64_t ld, const float* w, int64_t w_ld, int64_t G, float* acc,
                                  int64_t acc_ld) {
  constexpr int HB = DC <= 4 ? 4 : 3;
  int64_t h = 0;
  for (; h + HB <= G; h += HB) block_values512<DC, HB>(rows, ld, w + h * w_ld, w_ld, acc + h * acc_ld, acc_ld);
  const float* wr = w + h * w_ld;
  float* ar = acc + h * acc_ld;
  if (G - h == 1) block_values512<DC, 1>(rows, ld, wr, w_ld, ar, acc_ld);
  if (G - h == 2) block_values512<DC, 2>(rows, ld, wr, w_ld, ar, acc_ld);
  if constexpr (HB > 3) {
    if (G - h == 3) block_values512<DC, 3>(rows, ld, wr, w_ld, ar, acc_ld);
  }
}

// Bit j set where ok[j] != 0, for the m <= 16 bytes at ok.
AVX512BW inline __mmask16 block_bits(const void* ok, int64_t m) {
  const uint8_t* o = static_cast<const uint8_t*>(ok);
  if (m == kBlock) return _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)), _mm_set1_epi8(-1));
  __mmask16 bits = 0;
  for (int64_t r = 0; r < m; ++r) bits |= __mmask16(o[r] != 0) << r;
  return bits;
}

// Max of sc[0 .. n) (n a multiple of 16).
AVX512 inline float row_max512(const float* sc, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += kBlock) m = _mm512_max_ps(m, _mm512_loadu_ps(sc + j));
  return _mm512_reduce_max_ps(m);
}

// Each head's scores sc [G, padded] (n real slots) -> exp(score - max), and its partial in part [G, D + 2]:
// a zeroed accumulator, the max and the sum of exp (a head with no slot read: max -inf, sum 0, weights 0).
AVX512 void block_softmax512(float* sc, int64_t padded, int64_t n, int64_t G, int64_t D, float* part) {
  const float kNeg = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; ++g) {
    float* acc = part + g * (D + 2);
    float* row = sc + g * padded;
    std::fill(acc, acc + D, 0.f);
    const float mx = n ? row_max512(row, padded) : kNeg;
    acc[D] = mx;
    acc[D + 1] = mx == kNeg ? 0.f : exp_row512(row, padded, mx);
    if (mx == kNeg) std::fill(row, row + padded, 0.f);
  }
}
#endif

// Head dims the blocks take (D = 16 * DC).
inline bool blocks_take(int64_t d) { return d == 32 || d == 64 || d == 96 || d == 128; }

#if LLMEQ_X86
// The float cache's decode attention on blocks: slots [s0, s1) of (b, kvh), every query position and the
// group's G heads. part [T, G, D + 2]: per head the unnormalized output, its max score and sum of exp
// (merged across a row's chunks by at_merge). Scores as at_group's: q . k / sqrt(D) where the mask is set,
// else the finite `masked` (a row masked everywhere averages its values, like the reference).
template <int DC>
AVX512BW void at_task512(const AT& p, int64_t b, int64_t kvh, int64_t s0, int64_t s1, float* part) {
  constexpr int64_t D = 16 * DC;
  const int64_t G = p.H / p.KV, n = std::max<int64_t>(s1 - s0, 0), padded = cdiv(n, kBlock) * kBlock;
  const float kNeg = -std::numeric_limits<float>::infinity();
  thread_local std::vector<float> buf;
  buf.resize(kBlock * D + G * padded);
  float *tile = buf.data(), *sc = tile + kBlock * D;
  const float* kb = p.k + ((b * p.KV + kvh) * p.S + s0) * D;
  const float* vb = p.v + ((b * p.KV + kvh) * p.S + s0) * D;
  // A block's rows where they lie; the last, partial block copied into the tile with zero rows after it.
  auto rows_at = [&](const float* base, int64_t j0) -> const float* {
    const int64_t m = std::min<int64_t>(kBlock, n - j0);
    if (m == kBlock) return base + j0 * D;
    std::memcpy(tile, base + j0 * D, sizeof(float) * m * D);
    std::fill(tile + m * D, tile + kBlock * D, 0.f);
    return tile;
  };
  for (int64_t t = 0; t < p.T; ++t) {
    const bool* mk = p.mask + (b * p.T + t) * p.S + s0;
    const float* qb = p.q + ((b * p.T + t) * p.H + kvh * G) * D;
    float* pt = part + t * G * (D + 2);
    for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
      const int64_t m = std::min<int64_t>(kBlock, n - j0);
      block_scores512<DC>(rows_at(kb, j0), D, qb, G, p.inv_sqrt_d, nullptr, block_bits(mk + j0, m),
                          _mm512_set1_ps(p.masked), sc + j0, padded);
      for (int64_t g = 0; g < G; ++g)  // slots past the chunk weigh nothing
        std::fill(sc + g * padded + j0 + m, sc + g * padded + j0 + kBlock, kNeg);
    }
    block_softmax512(sc, padded, n, G, D, pt);
    for (int64_t j0 = 0; j0 < n; j0 += kBlock)
      block_values_heads512<DC>(rows_at(vb, j0), D, sc + j0, padded, G, pt, D + 2);
  }
}
#endif

// One output row from its chunks' partial softmaxes, chunk c's at parts + c * stride: [acc (D), max m_c, sum l_c].
// dst = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c with M the largest m_c; returns the row's log-sum-exp
// M + log(l), or -inf (dst zero) where no chunk saw a slot.
float merge_parts(const float* parts, int64_t stride, int64_t chunks, int64_t D, float* dst) {
  const float kNeg = -std::numeric_limits<float>::infinity();
  float m = kNeg;
  for (int64_t c = 0; c < chunks; ++c) m = std::max(m, parts[c * stride + D]);
  std::fill(dst, dst + D, 0.f);
  if (m == kNeg) return kNeg;
  float l = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* part = parts + c * stride;
    if (part[D] == kNeg) continue;
    const float w = std::exp(part[D] - m);
    l += w * part[D + 1];
    for (int64_t i = 0; i < D; ++i) dst[i] += w * part[i];
  }
  const float inv = 1.f / l;  // the chunk holding the max weighs 1 and its sum is >= 1
  for (int64_t i = 0; i < D; ++i) dst[i] *= inv;
  return m + std::log(l);
}

// out[b, t, h] from the chunks' parts [B * KV * chunks][T, G, D + 2] (merge_parts per row).
void at_merge(const AT& p, int64_t chunks, const float* parts) {
  const int64_t G = p.H / p.KV, part_size = p.T * G * (p.D + 2);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t kvh = 0; kvh < p.KV; ++kvh)
      for (int64_t t = 0; t < p.T; ++t)
        for (int64_t g = 0; g < G; ++g)
          merge_parts(parts + (b * p.KV + kvh) * chunks * part_size + (t * G + g) * (p.D + 2), part_size, chunks, p.D,
                      p.out + ((b * p.T + t) * p.H + kvh * G + g) * p.D);
}

#if LLMEQ_X86
// The float decode attention on AVX-512 blocks: (row, KV head, chunk of slots) tasks, then their merge.
void at_blocks(const AT& p) {
  const int64_t groups = p.B * p.KV, chunk = decode_chunk(groups, p.S), chunks = cdiv(p.S, chunk);
  const int64_t part_size = p.T * (p.H / p.KV) * (p.D + 2);
  std::vector<float> parts(groups * chunks * part_size);
  auto body = [&](int64_t i) {
    const int64_t grp = i / chunks, s0 = (i % chunks) * chunk, s1 = std::min(p.S, s0 + chunk);
    float* part = parts.data() + i * part_size;
    switch (p.D / 16) {
      case 2: at_task512<2>(p, grp / p.KV, grp % p.KV, s0, s1, part); break;
      case 4: at_task512<4>(p, grp / p.KV, grp % p.KV, s0, s1, part); break;
      case 6: at_task512<6>(p, grp / p.KV, grp % p.KV, s0, s1, part); break;
      default: at_task512<8>(p, grp / p.KV, grp % p.KV, s0, s1, part); break;
    }
  };
  if (2 * p.B * p.KV * p.S * p.D * 4 < min_parallel_bytes()) {
    for (int64_t i = 0; i < groups * chunks; ++i) body(i);
  } else {
    SpinPool::get().run(groups * chunks, body);
  }
  at_merge(p, chunks, parts.data());
}
#endif

// k, v are a stack of per-layer caches [L, B, KV, S, D] (a model's whole float KV cache) and
// ``layer`` says which one to read: slicing the layer out in XLA copied it on every decode step
// (at 512 cached positions ~2 ms of a 12 ms SmolLM2 step). A single cache is a stack of one.
ffi::Error at_impl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask,
                   ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, float masked) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || md.size() != 3 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("llmeq_decode_attention: q must be 4-D, k and v 5-D, mask 3-D, layer a scalar");
  AT p{};
  p.B = qd[0];
  p.T = qd[1];
  p.H = qd[2];
  p.D = qd[3];
  p.KV = kd[2];
  p.S = kd[3];
  if (kd[1] != p.B || kd[4] != p.D || vd[0] != kd[0] || vd[1] != p.B || vd[2] != p.KV || vd[3] != p.S || vd[4] != p.D)
    return ffi::Error::InvalidArgument("llmeq_decode_attention: k, v must be [L, B, KV, S, D] matching q");
  if (p.KV == 0 || p.H % p.KV) return ffi::Error::InvalidArgument("llmeq_decode_attention: heads must be a multiple of KV heads");
  if (md[0] != p.B || md[1] != p.T || md[2] != p.S) return ffi::Error::InvalidArgument("llmeq_decode_attention: mask must be [B, T, S]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0]) return ffi::Error::InvalidArgument("llmeq_decode_attention: layer out of range");
  const int64_t per_layer = p.B * p.KV * p.S * p.D;
  p.q = q.typed_data();
  p.k = k.typed_data() + l * per_layer;
  p.v = v.typed_data() + l * per_layer;
  p.mask = mask.typed_data();
  p.out = out->typed_data();
  p.masked = masked;
  p.inv_sqrt_d = 1.f / std::sqrt(static_cast<float>(p.D));
  if (p.B * p.T * p.H * p.D == 0) return ffi::Error::Success();
  if (p.S == 0) return ffi::Error::InvalidArgument("llmeq_decode_attention: empty cache");
  const bool simd = use_avx2();
#if LLMEQ_X86
  if (simd && p.T >= kFlashMinT) {
    // Tasks heaviest first (the last query blocks see the most keys under a causal mask).
    const int64_t nq = cdiv(p.T, kFlashQ), per = p.B * p.KV;
    auto flash = [&p, nq, per](int64_t i) {
      const int64_t qb = nq - 1 - i / per, bk = i % per;
      flash_task(p, bk / p.KV, bk % p.KV, qb * kFlashQ, std::min(p.T, (qb + 1) * kFlashQ));
    };
    SpinPool::get().run(nq * per, flash);
    return ffi::Error::Success();
  }
#endif
#if LLMEQ_X86
  if (simd && use_avx512() && blocks_take(p.D)) {
    at_blocks(p);
    return ffi::Error::Success();
  }
#endif
  auto body = [&p, simd](int64_t i) { at_group(p, i / p.KV, i % p.KV, simd); };
  int64_t tasks = p.B * p.KV;
  if (2 * p.B * p.KV * p.S * p.D * 4 < min_parallel_bytes()) {
    for (int64_t i = 0; i < tasks; ++i) body(i);
  } else {
    SpinPool::get().run(tasks, body);
  }
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------- quantized KV store attention
//
// One decode query per head over the quantized KV cache's store (llmeq_jax.kv.cache.QuantKVCache,
// the contract of pallas_kernels.kv_cache.store_decode_attention): codes int8, or int4 two per byte
// (low nibble first), asymmetric grids value = (code - qmin) * scale + lo, keys per channel
// (ks, klo), values per token (vs, vlo: float16 or float32), keys optionally stored before RoPE (rotated here
// by cos/sin tables of their slots' positions). Returns the attention output and the log-sum-exp
// of the scaled scores, so the cache merges it with its float parts (window, sinks). XLA's path
// dequantized and rotated the whole layer into memory every step: 0.40-0.61x the float cache's
// decode speed on a 2-core Xeon (rtn-w4-g128 weights, 1024 cached tokens; docs/kv-cache.md).
//
// Tasks: (batch row, KV head, chunk of slots); each keeps a softmax partial (max, sum, G x D
// accumulator) that the merge combines, so a batch-1 step over 3 KV heads still fills the cores.

struct KVS {
  int64_t B, Hq, KV, T, D, row_bytes, k_rows, G;
  int bits;
  const float* q;              // [B, Hq, D], already times sm_scale
  const int8_t *kc, *vc;       // this layer's codes [B, KV, T, row_bytes]
  const float *ks, *klo;       // key grid [k_rows, KV, D]
  const void *vs, *vlo;        // value grid [B, KV, T]
  bool v_half;
  const int8_t* allowed;       // [B, T] or null
  const float *cosv, *sinv;    // [B, T, D / 2] or null
  int64_t scan;                // slots 0 .. scan - 1 may be read
  const float *ke, *ve;        // this layer's float part (the cache's sinks) [B, KV, N, D], or null
  const int8_t* extra_ok;      // [B, N]: which float entries the query sees
  int64_t N;
};

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      uint32_t m = man;
      do { ++e; m <<= 1; } while (!(m & 0x400));
      bits = sign | uint32_t(127 - 15 - e) << 23 | (m & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float kvs_grid(const KVS& p, const void* g, int64_t i) {
  return p.v_half ? half_to_float(static_cast<const uint16_t*>(g)[i]) : static_cast<const float*>(g)[i];
}

// Codes of one stored row as floats, minus qmin (0 .. 2^bits - 1): flipping the sign bit.
void kvs_codes(const int8_t* row, int bits, int64_t d, float* out) {
  const uint8_t* u = reinterpret_cast<const uint8_t*>(row);
  if (bits == 8) {
    for (int64_t i = 0; i < d; ++i) out[i] = float(u[i] ^ 0x80);
    return;
  }
  for (int64_t j = 0; j < d / 2; ++j) {
    out[2 * j] = float((u[j] & 15) ^ 8);
    out[2 * j + 1] = float((u[j] >> 4) ^ 8);
  }
}

#if LLMEQ_X86
AVX2 void kvs_codes8_avx2(const int8_t* row, int64_t d, float* out) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    __m128i b = _mm_xor_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)), _mm_set1_epi8(char(0x80)));
    _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
  }
  for (; i < d; ++i) out[i] = float(uint8_t(row[i]) ^ 0x80);
}

// int4: 8 codes from 4 bytes (low nibble first), sign bit flipped.
AVX2 void kvs_codes4_avx2(const int8_t* row, int64_t d, float* out) {
  int64_t i = 0;
  const __m128i m15 = _mm_set1_epi32(15), m8 = _mm_set1_epi32(8);
  for (; i + 8 <= d; i += 8) {
    int32_t word;
    std::memcpy(&word, row + i / 2, 4);
    const __m128i x = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(word));
    const __m128i lo = _mm_xor_si128(_mm_and_si128(x, m15), m8), hi = _mm_xor_si128(_mm_srli_epi32(x, 4), m8);
    const __m256i v = _mm256_set_m128i(_mm_unpackhi_epi32(lo, hi), _mm_unpacklo_epi32(lo, hi));
    _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(v));
  }
  if (i < d) kvs_codes(row + i / 2, 4, d - i, out + i);
}

// Rotate-half RoPE of x [2h] in place by cos/sin [h]; tmp [2h] scratch.
AVX2 void kvs_rope_avx2(float* x, const float* c, const float* sn, int64_t h, float* tmp) {
  std::memcpy(tmp, x, sizeof(float) * 2 * h);
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    const __m256 a = _mm256_loadu_ps(tmp + i), b = _mm256_loadu_ps(tmp + h + i);
    const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(sn + i);
    _mm256_storeu_ps(x + i, _mm256_fnmadd_ps(b, sv, _mm256_mul_ps(a, cv)));
    _mm256_storeu_ps(x + h + i, _mm256_fmadd_ps(a, sv, _mm256_mul_ps(b, cv)));
  }
  for (; i < h; ++i) {
    x[i] = tmp[i] * c[i] - tmp[i + h] * sn[i];
    x[i + h] = tmp[i + h] * c[i] + tmp[i] * sn[i];
  }
}

AVX2 void kvs_affine_avx2(float* x, const float* s, const float* o, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(x + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(s + i), _mm256_loadu_ps(o + i)));
  for (; i < d; ++i) x[i] = x[i] * s[i] + o[i];
}
#endif

// The dequantized (and rotated) key of slot t of (b, kvh) into kf [D]; tmp [D] scratch.
void kvs_key(const KVS& p, int64_t b, int64_t kvh, int64_t t, bool simd, float* kf, float* tmp) {
  const int8_t* row = p.kc + ((b * p.KV + kvh) * p.T + t) * p.row_bytes;
  const int64_t grid = ((p.k_rows == 1 ? 0 : b) * p.KV + kvh) * p.D;
  const float *s = p.ks + grid, *o = p.klo + grid;
#if LLMEQ_X86
  if (simd) {
    if (p.bits == 8) kvs_codes8_avx2(row, p.D, kf);
    else kvs_codes4_avx2(row, p.D, kf);
    kvs_affine_avx2(kf, s, o, p.D);
  } else
#endif
  {
    kvs_codes(row, p.bits, p.D, kf);
    for (int64_t i = 0; i < p.D; ++i) kf[i] = kf[i] * s[i] + o[i];
  }
  if (!p.cosv) return;
  // rotate-half RoPE: x[i] cos - x[i + h] sin, x[i + h] cos + x[i] sin
  const int64_t h = p.D / 2;
  const float *c = p.cosv + (b * p.T + t) * h, *sn = p.sinv + (b * p.T + t) * h;
#if LLMEQ_X86
  if (simd) {
    kvs_rope_avx2(kf, c, sn, h, tmp);
    return;
  }
#endif
  std::memcpy(tmp, kf, sizeof(float) * p.D);
  for (int64_t i = 0; i < h; ++i) {
    kf[i] = tmp[i] * c[i] - tmp[i + h] * sn[i];
    kf[i + h] = tmp[i + h] * c[i] + tmp[i] * sn[i];
  }
}

#if LLMEQ_X86
// e[j] = exp(e[j] - m) for j < n (-inf, a slot not read, gives exactly 0); returns their sum.
AVX2 float kvs_exp_sum_avx2(float* e, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = exp256(_mm256_sub_ps(_mm256_loadu_ps(e + j), mv));
    _mm256_storeu_ps(e + j, x);
    acc = _mm256_add_ps(acc, x);
  }
  float sum = hsum(acc);
  for (; j < n; ++j) {
    e[j] = std::isinf(e[j]) ? 0.f : std::exp(e[j] - m);
    sum += e[j];
  }
  return sum;
}
#endif

// One task: slots [t0, t1) of (b, kvh) for the G query heads of the group. part = G x (D + 2):
// per head the unnormalized output, then its max score and sum of exp.
void kvs_task(const KVS& p, int64_t b, int64_t kvh, int64_t t0, int64_t t1, bool simd, float* part) {
  const int64_t G = p.G, D = p.D, n = std::max<int64_t>(t1 - t0, 0);
  std::vector<float> buf(2 * D + G * n + G * D);
  float *kf = buf.data(), *tmp = kf + D, *sc = tmp + D, *qf = sc + G * n;  // sc [G, n], qf [G, D]
  const float* qb = p.q + (b * p.Hq + kvh * G) * D;
  const float kNeg = -std::numeric_limits<float>::infinity();
  std::vector<float> mx(G, kNeg), q_lo(G, 0.f);
  // Post-RoPE keys: the per-channel grid folded into the queries, q . (u * s + lo) = (q * s) . u + q . lo,
  // so a key is only its codes. Pre-RoPE keys are dequantized and rotated (kvs_key).
  const bool fold = !p.cosv;
  const float* q_dot = qb;
  if (fold) {
    const int64_t grid = ((p.k_rows == 1 ? 0 : b) * p.KV + kvh) * D;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < D; ++i) {
        qf[g * D + i] = qb[g * D + i] * p.ks[grid + i];
        q_lo[g] += qb[g * D + i] * p.klo[grid + i];
      }
    q_dot = qf;
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = t0 + j;
    if (p.allowed && !p.allowed[b * p.T + t]) {
      for (int64_t g = 0; g < G; ++g) sc[g * n + j] = kNeg;
      continue;
    }
    if (fold) {
      const int8_t* row = p.kc + ((b * p.KV + kvh) * p.T + t) * p.row_bytes;
#if LLMEQ_X86
      if (simd) {
        if (p.bits == 8) kvs_codes8_avx2(row, D, kf);
        else kvs_codes4_avx2(row, D, kf);
      } else
#endif
        kvs_codes(row, p.bits, D, kf);
    } else {
      kvs_key(p, b, kvh, t, simd, kf, tmp);
    }
    for (int64_t g = 0; g < G; ++g) {
      float d;
#if LLMEQ_X86
      if (simd) d = at_dot_avx2(q_dot + g * D, kf, D);
      else
#endif
        d = at_dot_scalar(q_dot + g * D, kf, D);
      d += q_lo[g];
      sc[g * n + j] = d;
      mx[g] = std::max(mx[g], d);
    }
  }
  std::vector<float> vsum(G, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    float* acc = part + g * (D + 2);
    std::fill(acc, acc + D, 0.f);
    float l = 0.f;
    if (mx[g] != kNeg) {
#if LLMEQ_X86
      if (simd) {
        l = kvs_exp_sum_avx2(sc + g * n, n, mx[g]);
      } else
#endif
        for (int64_t j = 0; j < n; ++j) {
          const float e = sc[g * n + j] == kNeg ? 0.f : std::exp(sc[g * n + j] - mx[g]);
          sc[g * n + j] = e;
          l += e;
        }
    }
    acc[D] = mx[g];
    acc[D + 1] = l;
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = t0 + j, slot = (b * p.KV + kvh) * p.T + t;
    bool any = false;
    for (int64_t g = 0; g < G; ++g) any |= mx[g] != kNeg && sc[g * n + j] != 0.f;
    if (!any) continue;
    const int8_t* row = p.vc + slot * p.row_bytes;
#if LLMEQ_X86
    if (simd) {
      if (p.bits == 8) kvs_codes8_avx2(row, D, kf);
      else kvs_codes4_avx2(row, D, kf);
    } else
#endif
      kvs_codes(row, p.bits, D, kf);
    const float vs = kvs_grid(p, p.vs, slot), vo = kvs_grid(p, p.vlo, slot);
    for (int64_t g = 0; g < G; ++g) {
      if (mx[g] == kNeg) continue;
      const float w = sc[g * n + j];
      if (w == 0.f) continue;
      float* acc = part + g * (D + 2);
#if LLMEQ_X86
      if (simd) at_axpy_avx2(w * vs, kf, acc, D);
      else
#endif
        for (int64_t i = 0; i < D; ++i) acc[i] += w * vs * kf[i];
      vsum[g] += w * vo;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* acc = part + g * (D + 2);
    for (int64_t i = 0; i < D; ++i) acc[i] += vsum[g];  // sum_t w_t * vlo_t on every channel
  }
}

#if LLMEQ_X86
// Codes of one stored row as floats minus qmin (kvs_codes) in registers, D = 16 * DC: int8 16 a step; int4
// 16 from 8 bytes, both nibbles' sign bits flipped by one xor, then interleaved low nibble first.
template <int DC>
AVX512BW inline void kvs_code_regs512(const int8_t* row, int bits, __m512* k) {
  if (bits == 8) {
    for (int c = 0; c < DC; ++c) {
      const __m128i x = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)),
                                      _mm_set1_epi8(char(0x80)));
      k[c] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
    }
    return;
  }
  const __m128i m15 = _mm_set1_epi8(15);
  for (int c = 0; c < DC; ++c) {
    const __m128i x = _mm_xor_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c)),
                                    _mm_set1_epi8(char(0x88)));
    const __m128i lo = _mm_and_si128(x, m15), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m15);
    k[c] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  }
}

template <int DC>
AVX512BW inline void kvs_codes512(const int8_t* row, int bits, float* out) {
  __m512 k[DC];
  kvs_code_regs512<DC>(row, bits, k);
  for (int c = 0; c < DC; ++c) _mm512_storeu_ps(out + 16 * c, k[c]);
}

// A key stored before RoPE, dequantized ((code - qmin) * s + lo) and rotated (rotate-half by its slot's
// cos/sin [D / 2]) in registers (D / 2 = 8 * DC is a multiple of 16 for every even DC).
template <int DC>
AVX512BW inline void kvs_rope_key512(const int8_t* row, int bits, const float* s, const float* lo, const float* cs,
                                     const float* sn, float* out) {
  static_assert(DC % 2 == 0, "rotate-half needs whole 16-lane halves");
  constexpr int H = DC / 2;
  __m512 k[DC];
  kvs_code_regs512<DC>(row, bits, k);
  for (int c = 0; c < DC; ++c) k[c] = _mm512_fmadd_ps(k[c], _mm512_loadu_ps(s + 16 * c), _mm512_loadu_ps(lo + 16 * c));
  for (int c = 0; c < H; ++c) {
    const __m512 cv = _mm512_loadu_ps(cs + 16 * c), sv = _mm512_loadu_ps(sn + 16 * c);
    _mm512_storeu_ps(out + 16 * c, _mm512_fnmadd_ps(k[c + H], sv, _mm512_mul_ps(k[c], cv)));
    _mm512_storeu_ps(out + 16 * (c + H), _mm512_fmadd_ps(k[c], sv, _mm512_mul_ps(k[c + H], cv)));
  }
}

// The value grid (scale or offset) of 16 slots from `first`, zero past m.
AVX512BW inline __m512 kvs_grid512(const KVS& p, const void* g, int64_t first, int64_t m) {
  if (m == kBlock)
    return p.v_half ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + first)))
                    : _mm512_loadu_ps(static_cast<const float*>(g) + first);
  alignas(64) float x[kBlock] = {};
  for (int64_t r = 0; r < m; ++r) x[r] = kvs_grid(p, g, first + r);
  return _mm512_load_ps(x);
}

// kvs_task on AVX-512 blocks (same part layout): a block's key rows decoded into an L1 tile (post-RoPE:
// the codes alone, the grid folded into the queries; pre-RoPE: dequantized and rotated), scored by
// block_scores512; its value rows decoded once and summed for every head by block_values_heads512 with
// weights p * scale, the offsets' share (sum p * lo) added per head at the end.
template <int DC>
AVX512BW void kvs_task512(const KVS& p, int64_t b, int64_t kvh, int64_t t0, int64_t t1, float* part) {
  constexpr int64_t D = 16 * DC;
  const int64_t G = p.G, n = std::max<int64_t>(t1 - t0, 0), padded = cdiv(n, kBlock) * kBlock;
  const float kNeg = -std::numeric_limits<float>::infinity();
  thread_local std::vector<float> buf;
  buf.resize(kBlock * D + G * D + G * padded + 2 * G * kBlock + G);
  float *tile = buf.data(), *qf = tile + kBlock * D, *sc = qf + G * D, *w = sc + G * padded;
  float *vsum = w + G * kBlock, *q_lo = vsum + G * kBlock;
  const float* qb = p.q + (b * p.Hq + kvh * G) * D;
  const int64_t grid = ((p.k_rows == 1 ? 0 : b) * p.KV + kvh) * D, first = (b * p.KV + kvh) * p.T + t0;
  const float *ks = p.ks + grid, *klo = p.klo + grid;
  const bool fold = !p.cosv;
  for (int64_t g = 0; g < G; ++g) {
    q_lo[g] = 0.f;
    for (int64_t i = 0; i < D; ++i) {
      qf[g * D + i] = fold ? qb[g * D + i] * ks[i] : qb[g * D + i];
      q_lo[g] += qb[g * D + i] * klo[i];
    }
  }
  const int64_t half = D / 2;
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t m = std::min<int64_t>(kBlock, n - j0);
    __mmask16 ok = __mmask16((1u << m) - 1);
    if (p.allowed) ok &= block_bits(p.allowed + b * p.T + t0 + j0, m);
    if (!ok) {
      for (int64_t g = 0; g < G; ++g) std::fill(sc + g * padded + j0, sc + g * padded + j0 + kBlock, kNeg);
      continue;
    }
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* row = p.kc + (first + j0 + r) * p.row_bytes;
      if (fold) {
        kvs_codes512<DC>(row, p.bits, tile + r * D);
        continue;
      }
      const int64_t at = (b * p.T + t0 + j0 + r) * half;
      kvs_rope_key512<DC>(row, p.bits, ks, klo, p.cosv + at, p.sinv + at, tile + r * D);
    }
    std::fill(tile + m * D, tile + kBlock * D, 0.f);
    block_scores512<DC>(tile, D, qf, G, 1.f, fold ? q_lo : nullptr, ok, _mm512_set1_ps(kNeg), sc + j0, padded);
  }
  block_softmax512(sc, padded, n, G, D, part);
  std::fill(vsum, vsum + G * kBlock, 0.f);
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t m = std::min<int64_t>(kBlock, n - j0);
    __mmask16 any = 0;
    for (int64_t g = 0; g < G; ++g)
      any |= _mm512_cmp_ps_mask(_mm512_loadu_ps(sc + g * padded + j0), _mm512_setzero_ps(), _CMP_NEQ_OQ);
    if (!any) continue;  // masked (or underflowed) slots only
    const __m512 vs = kvs_grid512(p, p.vs, first + j0, m), vo = kvs_grid512(p, p.vlo, first + j0, m);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 pv = _mm512_loadu_ps(sc + g * padded + j0);
      _mm512_storeu_ps(w + g * kBlock, _mm512_mul_ps(pv, vs));
      _mm512_storeu_ps(vsum + g * kBlock, _mm512_fmadd_ps(pv, vo, _mm512_loadu_ps(vsum + g * kBlock)));
    }
    for (int64_t r = 0; r < m; ++r) kvs_codes512<DC>(p.vc + (first + j0 + r) * p.row_bytes, p.bits, tile + r * D);
    std::fill(tile + m * D, tile + kBlock * D, 0.f);
    block_values_heads512<DC>(tile, D, w, kBlock, G, part, D + 2);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float off = _mm512_reduce_add_ps(_mm512_loadu_ps(vsum + g * kBlock));
    for (int64_t i = 0; i < D; ++i) part[g * (D + 2) + i] += off;  // sum_t p_t * vlo_t on every channel
  }
}
#endif

// The float part (the cache's sinks: a few float keys and values of this layer, post-RoPE) as one more softmax
// partial of (b, kvh), part laid out as kvs_task's: the kernel's result is then the attention over the store and
// the sinks together, and the cache needs no merge of its own (XLA's was ~20 small ops per layer).
void kvs_extra_part(const KVS& p, int64_t b, int64_t kvh, bool simd, float* part) {
  const int64_t G = p.G, D = p.D, N = p.N;
  const float kNeg = -std::numeric_limits<float>::infinity();
  const float* kb = p.ke + (b * p.KV + kvh) * N * D;
  const float* vb = p.ve + (b * p.KV + kvh) * N * D;
  std::vector<float> sc(N);
  for (int64_t g = 0; g < G; ++g) {
    const float* qv = p.q + (b * p.Hq + kvh * G + g) * D;
    float* acc = part + g * (D + 2);
    std::fill(acc, acc + D, 0.f);
    float m = kNeg, l = 0.f;
    for (int64_t n = 0; n < N; ++n) {
      float d = kNeg;
      if (p.extra_ok[b * N + n]) {
#if LLMEQ_X86
        d = simd ? at_dot_avx2(qv, kb + n * D, D) : at_dot_scalar(qv, kb + n * D, D);
#else
        d = at_dot_scalar(qv, kb + n * D, D);
#endif
      }
      sc[n] = d;
      m = std::max(m, d);
    }
    if (m != kNeg)
      for (int64_t n = 0; n < N; ++n) {
        if (sc[n] == kNeg) continue;
        const float e = std::exp(sc[n] - m);
        l += e;
        for (int64_t i = 0; i < D; ++i) acc[i] += e * vb[n * D + i];
      }
    acc[D] = m;
    acc[D + 1] = l;
  }
}

ffi::Error kvs_impl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kc, ffi::AnyBuffer vc, ffi::Buffer<ffi::F32> ks,
                    ffi::Buffer<ffi::F32> klo, ffi::AnyBuffer vs, ffi::AnyBuffer vlo, ffi::Buffer<ffi::S8> allowed,
                    ffi::Buffer<ffi::F32> cosv, ffi::Buffer<ffi::F32> sinv, ffi::Buffer<ffi::S32> scan,
                    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> ke, ffi::Buffer<ffi::F32> ve,
                    ffi::Buffer<ffi::S8> extra_ok, ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                    int64_t bits, int64_t masked, int64_t rope, int64_t extra) {
  const char* name = "llmeq_kv_store_attention: ";
  auto qd = q.dimensions(), kd = kc.dimensions(), vd = vc.dimensions(), sd = ks.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || vd.size() != 5 || sd.size() != 3 || klo.element_count() != ks.element_count())
    return ffi::Error::InvalidArgument(std::string(name) + "q must be [B, Hq, D], codes [L, B, KV, T, bytes], "
                                       "the key grid [1 or B, KV, D]");
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument(std::string(name) + "bits must be 4 or 8");
  KVS p{};
  p.bits = int(bits);
  p.B = qd[0];
  p.Hq = qd[1];
  p.D = qd[2];
  p.KV = kd[2];
  p.T = kd[3];
  p.row_bytes = kd[4];
  p.k_rows = sd[0];
  if (kd[1] != p.B || p.KV == 0 || p.Hq % p.KV || p.row_bytes != (bits == 8 ? p.D : p.D / 2) || (bits == 4 && p.D % 2))
    return ffi::Error::InvalidArgument(std::string(name) + "codes must be [L, B, KV, T, D or D / 2] matching q");
  for (int64_t i = 0; i < 5; ++i)
    if (vd[i] != kd[i]) return ffi::Error::InvalidArgument(std::string(name) + "value codes must match key codes");
  if ((p.k_rows != 1 && p.k_rows != p.B) || sd[1] != p.KV || sd[2] != p.D)
    return ffi::Error::InvalidArgument(std::string(name) + "key grid must be [1 or B, KV, D]");
  if (kc.element_type() != ffi::S8 && kc.element_type() != ffi::U8)
    return ffi::Error::InvalidArgument(std::string(name) + "codes must be int8 or uint8");
  const auto vt = vs.element_type();
  if ((vt != ffi::F16 && vt != ffi::F32) || vlo.element_type() != vt || int64_t(vs.element_count()) != kd[0] * p.B * p.KV * p.T ||
      vlo.element_count() != vs.element_count())
    return ffi::Error::InvalidArgument(std::string(name) + "value grids must be [L, B, KV, T, 1] float16 or float32");
  if (masked && int64_t(allowed.element_count()) != p.B * p.T)
    return ffi::Error::InvalidArgument(std::string(name) + "allowed must be [B, T]");
  if (rope && (int64_t(cosv.element_count()) != p.B * p.T * (p.D / 2) || sinv.element_count() != cosv.element_count() || p.D % 2))
    return ffi::Error::InvalidArgument(std::string(name) + "RoPE tables must be [B, T, D / 2]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0]) return ffi::Error::InvalidArgument(std::string(name) + "layer out of range");
  if (extra) {
    auto ed = ke.dimensions();
    if (ed.size() != 5 || ed[0] != kd[0] || ed[1] != p.B || ed[2] != p.KV || ed[4] != p.D ||
        ve.element_count() != ke.element_count() || int64_t(extra_ok.element_count()) != p.B * ed[3])
      return ffi::Error::InvalidArgument(std::string(name) + "the float part must be [L, B, KV, N, D] keys and values "
                                         "matching the codes, and its mask [B, N]");
    p.N = ed[3];
    const int64_t per = p.B * p.KV * p.N * p.D;
    p.ke = ke.typed_data() + l * per;
    p.ve = ve.typed_data() + l * per;
    p.extra_ok = extra_ok.typed_data();
  }
  const int64_t per_layer = p.B * p.KV * p.T;
  p.G = p.Hq / p.KV;
  p.q = q.typed_data();
  p.kc = static_cast<const int8_t*>(kc.untyped_data()) + l * per_layer * p.row_bytes;
  p.vc = static_cast<const int8_t*>(vc.untyped_data()) + l * per_layer * p.row_bytes;
  p.ks = ks.typed_data();
  p.klo = klo.typed_data();
  p.v_half = vt == ffi::F16;
  const int64_t grid_bytes = p.v_half ? 2 : 4;
  p.vs = static_cast<const char*>(vs.untyped_data()) + l * per_layer * grid_bytes;
  p.vlo = static_cast<const char*>(vlo.untyped_data()) + l * per_layer * grid_bytes;
  p.allowed = masked ? allowed.typed_data() : nullptr;
  p.cosv = rope ? cosv.typed_data() : nullptr;
  p.sinv = rope ? sinv.typed_data() : nullptr;
  p.scan = std::min<int64_t>(std::max<int64_t>(scan.typed_data()[0], 0), p.T);
  float* o = out->typed_data();
  float* ls = lse->typed_data();
  const bool simd = use_avx2();
  const int64_t groups = p.B * p.KV, reads = std::max<int64_t>(p.scan, 1);
  const int64_t chunk = decode_chunk(groups, reads), chunks = cdiv(reads, chunk);
  // Per group: its chunks' partials, then the float part's (the sinks; an empty partial without them).
  const int64_t part_size = p.G * (p.D + 2), per_group = chunks + 1;
  std::vector<float> parts(groups * per_group * part_size);
#if LLMEQ_X86
  const bool blocks = simd && use_avx512() && blocks_take(p.D);
#else
  const bool blocks = false;
#endif
  auto body = [&](int64_t i) {
    const int64_t grp = i / chunks, c = i % chunks, t0 = c * chunk, t1 = std::min(p.scan, t0 + chunk);
    const int64_t b = grp / p.KV, kvh = grp % p.KV;
    float* part = parts.data() + (grp * per_group + c) * part_size;
#if LLMEQ_X86
    if (blocks) {
      switch (p.D / 16) {
        case 2: kvs_task512<2>(p, b, kvh, t0, t1, part); break;
        case 4: kvs_task512<4>(p, b, kvh, t0, t1, part); break;
        case 6: kvs_task512<6>(p, b, kvh, t0, t1, part); break;
        default: kvs_task512<8>(p, b, kvh, t0, t1, part); break;
      }
      return;
    }
#endif
    kvs_task(p, b, kvh, t0, t1, simd, part);
  };
  const int64_t bytes = per_layer * p.row_bytes * 2;
  if (bytes < min_parallel_bytes()) {
    for (int64_t i = 0; i < groups * chunks; ++i) body(i);
  } else {
    SpinPool::get().run(groups * chunks, body);
  }
  const float kNeg = -std::numeric_limits<float>::infinity();
  for (int64_t grp = 0; grp < groups; ++grp) {
    const int64_t b = grp / p.KV, kvh = grp % p.KV;
    float* extra_part = parts.data() + (grp * per_group + chunks) * part_size;
    if (p.ke) {
      kvs_extra_part(p, b, kvh, simd, extra_part);
    } else {
      for (int64_t g = 0; g < p.G; ++g) extra_part[g * (p.D + 2) + p.D] = kNeg;
    }
    for (int64_t g = 0; g < p.G; ++g) {
      const int64_t h = kvh * p.G + g;
      const float lse = merge_parts(parts.data() + grp * per_group * part_size + g * (p.D + 2), part_size, per_group,
                                    p.D, o + (b * p.Hq + h) * p.D);
      // no slot allowed: a zero row, weighed ~0 by the cache's float parts where it has any
      ls[b * p.Hq + h] = lse == kNeg ? -1e30f : lse;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// KV store append: a step's keys (on the calibrated per-channel grid) and values (each token on its own min/max
// grid, float16 or float32) quantized and written into the stacked store in place (the outputs alias the store's
// buffers). Bit for bit what llmeq_jax.kv.grid's quantize_per_channel / quantize_per_token and XLA's
// dynamic_update_slice write; one call where XLA ran ~8 small ops a layer, each costing ~4 us of dispatch on a CPU.

// float -> IEEE half bits, round to nearest even (XLA's convert), overflow to inf.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return uint16_t(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {  // below 2^-14: a half subnormal, in units of 2^-24 (exact scaling, then ties to even)
    float v;
    std::memcpy(&v, &a, 4);
    return uint16_t(sign | uint32_t(std::nearbyint(v * 16777216.0f)));
  }
  uint32_t h = ((((a >> 23) - 127 + 15) << 10) | ((a & 0x7fffffu) >> 13));
  const uint32_t rest = a & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return uint16_t(sign | h);
}

// The next half towards -inf / +inf (finite, non-NaN inputs), as jnp.nextafter on float16.
inline uint16_t half_down(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x8001u;
  return (h & 0x8000u) ? uint16_t(h + 1) : uint16_t(h - 1);
}
inline uint16_t half_up(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001u;
  return (h & 0x8000u) ? uint16_t(h - 1) : uint16_t(h + 1);
}

// Codes of x on the grid (scale, lo): clip(round((x - lo) / scale), 0, levels) + qmin, as kv.grid.quantize_grid.
inline int8_t grid_code(float x, float scale, float lo, int bits) {
  const float levels = float((1 << bits) - 1);
  const float u = std::min(std::max(std::nearbyint((x - lo) / scale), 0.0f), levels);
  return int8_t(int(u) - (1 << (bits - 1)));
}

// One row of D codes into the store's bytes: int8 as is, int4 two per byte, low nibble first.
inline void put_codes(const int8_t* q, int64_t d, int bits, uint8_t* row) {
  if (bits == 8) {
    std::memcpy(row, q, d);
    return;
  }
  for (int64_t j = 0; j < d / 2; ++j) row[j] = uint8_t((q[2 * j] & 0xf) | ((q[2 * j + 1] & 0xf) << 4));
}

ffi::Error kva_impl(ffi::AnyBuffer kc_in, ffi::AnyBuffer vc_in, ffi::AnyBuffer vs_in, ffi::AnyBuffer vlo_in,
                    ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> ks,
                    ffi::Buffer<ffi::F32> klo, ffi::Buffer<ffi::S32> start_buf, ffi::Buffer<ffi::S32> layer_buf,
                    ffi::Result<ffi::AnyBuffer> kc, ffi::Result<ffi::AnyBuffer> vc, ffi::Result<ffi::AnyBuffer> vs,
                    ffi::Result<ffi::AnyBuffer> vlo, int64_t bits) {
  const char* name = "llmeq_kv_store_append: ";
  auto cd = kc->dimensions(), xd = k.dimensions(), sd = ks.dimensions();
  if (cd.size() != 5 || xd.size() != 4 || sd.size() != 3 || v.dimensions().size() != 4)
    return ffi::Error::InvalidArgument(std::string(name) + "codes must be [L, B, KV, S, bytes], keys and values "
                                       "[B, KV, T, D], the key grid [1 or B, KV, D]");
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument(std::string(name) + "bits must be 4 or 8");
  const int64_t L = cd[0], B = cd[1], KV = cd[2], S = cd[3], row = cd[4], T = xd[2], D = xd[3];
  if (xd[0] != B || xd[1] != KV || row != (bits == 8 ? D : D / 2) || (bits == 4 && D % 2) || T > S ||
      v.element_count() != k.element_count() || (sd[0] != 1 && sd[0] != B) || sd[1] != KV || sd[2] != D ||
      klo.element_count() != ks.element_count())
    return ffi::Error::InvalidArgument(std::string(name) + "keys/values [B, KV, T, D] do not match the codes");
  const auto vt = vs->element_type();
  if ((vt != ffi::F16 && vt != ffi::F32) || vlo->element_type() != vt || int64_t(vs->element_count()) != L * B * KV * S)
    return ffi::Error::InvalidArgument(std::string(name) + "value grids must be [L, B, KV, S, 1] float16 or float32");
  const int64_t l = layer_buf.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument(std::string(name) + "layer out of range");
  // dynamic_update_slice's rule: the start is clamped so that the T new slots fit
  const int64_t start = std::min<int64_t>(std::max<int64_t>(start_buf.typed_data()[0], 0), S - T);
  // The outputs alias the inputs; where XLA did not alias them, start from a copy of the store.
  const ffi::AnyBuffer* ins[4] = {&kc_in, &vc_in, &vs_in, &vlo_in};
  void* outs[4] = {kc->untyped_data(), vc->untyped_data(), vs->untyped_data(), vlo->untyped_data()};
  for (int i = 0; i < 4; ++i)
    if (ins[i]->untyped_data() != outs[i]) std::memcpy(outs[i], ins[i]->untyped_data(), ins[i]->size_bytes());
  const float *kx = k.typed_data(), *vx = v.typed_data(), *kscale = ks.typed_data(), *klow = klo.typed_data();
  const int levels = (1 << bits) - 1;
  std::vector<int8_t> q(D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < KV; ++h) {
      const int64_t grid = ((sd[0] == 1 ? 0 : b) * KV + h) * D;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t src = ((b * KV + h) * T + t) * D, slot = ((l * B + b) * KV + h) * S + start + t;
        for (int64_t j = 0; j < D; ++j) q[j] = grid_code(kx[src + j], kscale[grid + j], klow[grid + j], int(bits));
        put_codes(q.data(), D, int(bits), static_cast<uint8_t*>(outs[0]) + slot * row);
        // values: the token's own grid, rounded to the store's dtype as kv.grid.grid_from_range rounds it
        float lo = vx[src], hi = vx[src];
        for (int64_t j = 1; j < D; ++j) {
          lo = std::min(lo, vx[src + j]);
          hi = std::max(hi, vx[src + j]);
        }
        // (float16 whatever the store's dtype: a float32 store holds the float16 grid's values)
        uint16_t lo_h = float_to_half(lo);
        if (half_to_float(lo_h) > lo) lo_h = half_down(lo_h);
        const float lo_s = half_to_float(lo_h), span = hi - lo_s;
        float scale = span > 0 ? span / float(levels) : 1.0f;
        scale = std::max(scale, 6.103515625e-05f);  // float16's smallest normal (grid_from_range's floor)
        uint16_t scale_h = float_to_half(scale);
        if (half_to_float(scale_h) < scale) scale_h = half_up(scale_h);
        const float scale_s = half_to_float(scale_h);
        for (int64_t j = 0; j < D; ++j) q[j] = grid_code(vx[src + j], scale_s, lo_s, int(bits));
        put_codes(q.data(), D, int(bits), static_cast<uint8_t*>(outs[1]) + slot * row);
        if (vt == ffi::F16) {
          static_cast<uint16_t*>(outs[2])[slot] = scale_h;
          static_cast<uint16_t*>(outs[3])[slot] = lo_h;
        } else {
          static_cast<float*>(outs[2])[slot] = scale_s;
          static_cast<float*>(outs[3])[slot] = lo_s;
        }
      }
    }
  return ffi::Error::Success();
}

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
                                  .Arg<ffi::Buffer<ffi::F32>>()
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
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
__attribute__((visibility("default"))) int llmeq_native_abi_version() { return 16; }
}
