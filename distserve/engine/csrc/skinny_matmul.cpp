// y = x @ w.T for a few rows of x: a weight-streaming GEMV/GEMM for small-batch decode.
//
// x: [M, K] (float32 or bfloat16), w: [N, K] of x's dtype, row-major as stored in the checkpoint.
// returns [M, N] in x's dtype; products and sums in float32.
//
// Small-batch decode is bound by reading the weights once per step; library GEMMs tile for large M
// and read them well below the memory bandwidth there. With AVX-512 or AVX2 + FMA (the -march=native
// build finds them; float32 only on AVX2), a tile of TILE_N weight rows is read once per K step and multiplied into every row of x,
// which stays in L1: TILE_N * ROWS float32 accumulators live in registers, so the weight streams
// in order and each byte is read from memory once. bfloat16 uses the AVX512-BF16 dot-product
// instruction (pairs of bf16 products summed into float32) where the CPU has it. Elsewhere a
// portable loop does the same maths (each weight row widened to float32 once, one dot per row).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "widen.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE_N = 4;  // weight rows per tile
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048  // into L1
#endif
#ifndef PREFETCH_L2_BYTES
#define PREFETCH_L2_BYTES 8192  // into L2
#endif

// The portable path: one weight row widened to float32 (L1-resident), dotted with every row of x.
template <typename scalar_t>
void portable_rows(const float* x, const scalar_t* w, scalar_t* y, int64_t m, int64_t n, int64_t k,
                   int64_t begin, int64_t end) {
  std::vector<float> row(k);
  for (int64_t j = begin; j < end; ++j) {
    const float* wj = row.data();
    if constexpr (std::is_same_v<scalar_t, float>) {
      wj = reinterpret_cast<const float*>(w + j * k);
    } else {
      widen<scalar_t>(w + j * k, row.data(), k);
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = x + i * k;
      float dot = 0.0f;
      for (int64_t t = 0; t < k; ++t) dot += xi[t] * wj[t];
      y[i * n + j] = scalar_t(dot);
    }
  }
}

// The float32 vector register the tiled path accumulates in: AVX-512's 16 lanes, or AVX2's 8 (AMD
// Zen 2/3 and older Xeons, with FMA). ROWS of x per pass over a tile: TILE_N * ROWS accumulators,
// TILE_N weight registers and one of x must fit the register file (32 zmm; 16 ymm: 8 + 4 + 1).
namespace {
#if defined(__AVX512F__)
#define SKINNY_VECTOR_PATH 1
using vreg = __m512;
constexpr int64_t kLanes = 16;
constexpr int64_t ROWS = 4;
inline vreg vzero() { return _mm512_setzero_ps(); }
inline vreg vload(const float* p) { return _mm512_loadu_ps(p); }
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vreg a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
#define SKINNY_VECTOR_PATH 1
using vreg = __m256;
constexpr int64_t kLanes = 8;
constexpr int64_t ROWS = 2;
inline vreg vzero() { return _mm256_setzero_ps(); }
inline vreg vload(const float* p) { return _mm256_loadu_ps(p); }
inline vreg vfma(vreg a, vreg b, vreg c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vreg a) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps(half, half, 1)));
}
#endif
}  // namespace

#if defined(SKINNY_VECTOR_PATH)
// Elements of one K step: a register of float32 lanes, or 32 bfloat16 (16 pairs, AVX512-BF16 only).
template <typename scalar_t>
constexpr int64_t kStep = std::is_same_v<scalar_t, float> ? kLanes : 32;

template <typename scalar_t>
inline bool vector_path_supported(int64_t k) {
#if !defined(__AVX512BF16__)
  if constexpr (!std::is_same_v<scalar_t, float>) return false;
#endif
  return k % kStep<scalar_t> == 0;
}

// acc[r] += x . w[r] over one K step, for the R <= ROWS rows of x and TILE_N weight rows at w.
template <typename scalar_t, int R>
inline void tile_step(const scalar_t* x, int64_t k, const scalar_t* w, int64_t t, vreg (&acc)[ROWS][TILE_N]) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    vreg wv[TILE_N];
    for (int c = 0; c < TILE_N; ++c) wv[c] = vload(w + c * k + t);
    for (int r = 0; r < R; ++r) {
      const vreg xv = vload(x + r * k + t);
      for (int c = 0; c < TILE_N; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  } else {
#if defined(__AVX512BF16__)
    __m512bh wv[TILE_N];
    for (int c = 0; c < TILE_N; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * k + t);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + t);
      for (int c = 0; c < TILE_N; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
#endif
  }
}

// y[r, j .. j + TILE_N) for R rows of x starting at x (row stride k), weight rows j .. j + TILE_N.
template <typename scalar_t, int R>
inline void tile(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t n, int64_t k, int64_t j) {
  vreg acc[ROWS][TILE_N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) acc[r][c] = vzero();
  const scalar_t* wj = w + j * k;
  // The tile is TILE_N * k contiguous elements, consumed TILE_N lines per K step; prefetch as many
  // lines PREFETCH_BYTES further on into L1 and PREFETCH_L2_BYTES further on into L2 each step. The
  // far L2 prefetch keeps enough misses in flight to stream near bandwidth, which the L1 one alone
  // does not (it is bounded by L1's miss buffers). One core streaming a model's linears at batch 1,
  // bf16 and fp32 alike: weights on 4 KiB pages 15-40% faster with it (any distance of 8-32 KiB),
  // on huge pages (host_memory.py) 0-25% faster at 8 KiB and ~10% slower at 16-32 KiB.
  constexpr int64_t step_bytes = TILE_N * kStep<scalar_t> * sizeof(scalar_t);  // consumed per K step
  const char* ahead = reinterpret_cast<const char*>(wj) + PREFETCH_BYTES;
  const char* far_ahead = reinterpret_cast<const char*>(wj) + PREFETCH_L2_BYTES;
  for (int64_t t = 0; t < k; t += kStep<scalar_t>, ahead += step_bytes, far_ahead += step_bytes) {
    for (int64_t line = 0; line < step_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    for (int64_t line = 0; line < step_bytes; line += 64) _mm_prefetch(far_ahead + line, _MM_HINT_T1);
    tile_step<scalar_t, R>(x, k, wj, t, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) y[r * n + j + c] = scalar_t(vsum(acc[r][c]));
}

// tile<R> for the R = rows (1 .. ROWS) left in this pass.
template <typename scalar_t, int R = ROWS>
inline void tile_rows(int64_t rows, const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t n, int64_t k, int64_t j) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<scalar_t, R - 1>(rows, x, w, y, n, k, j);
  }
  tile<scalar_t, R>(x, w, y, n, k, j);
}

template <typename scalar_t>
void vector_rows(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t m, int64_t n, int64_t k,
                 int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; j += TILE_N) {
    for (int64_t i = 0; i < m; i += ROWS) {  // the tile stays in L1 between passes
      const scalar_t* xi = x + i * k;
      scalar_t* yi = y + i * n;
      tile_rows<scalar_t>(std::min<int64_t>(ROWS, m - i), xi, w, yi, n, k, j);
    }
  }
}
#endif

}  // namespace

// True when skinny_linear runs the register-tiled AVX-512 path for this dtype (and a K that fits).
static bool skinny_vectorised(at::ScalarType dtype) {
#if defined(SKINNY_VECTOR_PATH)
  if (dtype == at::kFloat) return true;
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#endif
  return false;
}

at::Tensor skinny_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "skinny_linear: x and w dtypes differ");
  auto wc = w.contiguous();
  auto xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto y = at::empty({m, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "skinny_linear", [&] {
    const scalar_t* w_ptr = wc.data_ptr<scalar_t>();
    scalar_t* y_ptr = y.data_ptr<scalar_t>();
#if defined(SKINNY_VECTOR_PATH)
    if (skinny_vectorised(x.scalar_type()) && vector_path_supported<scalar_t>(k)) {
      const scalar_t* x_ptr = xc.data_ptr<scalar_t>();
      const int64_t tiled = n - n % TILE_N;
      at::parallel_for(0, tiled / TILE_N, 16, [&](int64_t begin, int64_t end) {
        vector_rows<scalar_t>(x_ptr, w_ptr, y_ptr, m, n, k, begin * TILE_N, end * TILE_N);
      });
      if (tiled < n) {  // the last N % TILE_N weight rows
        auto xf = xc.to(at::kFloat).contiguous();
        portable_rows<scalar_t>(xf.data_ptr<float>(), w_ptr, y_ptr, m, n, k, tiled, n);
      }
      return;
    }
#endif
    auto xf = xc.to(at::kFloat).contiguous();  // [M, K], small: stays in cache for every weight row
    const float* x_ptr = xf.data_ptr<float>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      portable_rows<scalar_t>(x_ptr, w_ptr, y_ptr, m, n, k, begin, end);
    });
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
  m.impl("skinny_linear", c10::DispatchKey::CPU, &skinny_linear);
}
