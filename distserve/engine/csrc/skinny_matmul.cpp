// y = x @ w.T for a few rows of x: a weight-streaming GEMV/GEMM for small-batch decode.
//
// x: [M, K] (float32 or bfloat16), w: [N, K] of x's dtype, row-major as stored in the checkpoint.
// returns [M, N] in x's dtype; products and sums in float32.
//
// Small-batch decode is bound by reading the weights once per step; library GEMMs tile for large M
// and read them well below the memory bandwidth there. With AVX-512 (the -march=native build finds
// it), a tile of TILE_N weight rows is read once per K step and multiplied into every row of x,
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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE_N = 4;  // weight rows per tile
constexpr int64_t ROWS = 4;    // rows of x per pass over a tile (TILE_N * ROWS accumulators)
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

#if defined(__AVX512F__)
// Elements of one K step: 16 float32 lanes, or 32 bfloat16 (16 pairs).
template <typename scalar_t>
constexpr int64_t kStep = std::is_same_v<scalar_t, float> ? 16 : 32;

template <typename scalar_t>
inline bool vector_path_supported(int64_t k) {
#if !defined(__AVX512BF16__)
  if constexpr (!std::is_same_v<scalar_t, float>) return false;
#endif
  return k % kStep<scalar_t> == 0;
}

// acc[r] += x . w[r] over one K step, for the R <= ROWS rows of x and TILE_N weight rows at w.
template <typename scalar_t, int R>
inline void tile_step(const scalar_t* x, int64_t k, const scalar_t* w, int64_t t, __m512 (&acc)[ROWS][TILE_N]) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    __m512 wv[TILE_N];
    for (int c = 0; c < TILE_N; ++c) wv[c] = _mm512_loadu_ps(w + c * k + t);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * k + t);
      for (int c = 0; c < TILE_N; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
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
  __m512 acc[ROWS][TILE_N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) acc[r][c] = _mm512_setzero_ps();
  const scalar_t* wj = w + j * k;
  // The tile is TILE_N * k contiguous elements, consumed TILE_N lines per K step; prefetch as many
  // lines PREFETCH_BYTES further on into L1 and PREFETCH_L2_BYTES further on into L2 each step. The
  // far L2 prefetch keeps enough misses in flight to stream near bandwidth, which the L1 one alone
  // does not (it is bounded by L1's miss buffers). One core streaming a model's linears at batch 1,
  // bf16 and fp32 alike: weights on 4 KiB pages 15-40% faster with it (any distance of 8-32 KiB),
  // on huge pages (host_memory.py) 0-25% faster at 8 KiB and ~10% slower at 16-32 KiB.
  const char* ahead = reinterpret_cast<const char*>(wj) + PREFETCH_BYTES;
  const char* far_ahead = reinterpret_cast<const char*>(wj) + PREFETCH_L2_BYTES;
  for (int64_t t = 0; t < k; t += kStep<scalar_t>, ahead += TILE_N * 64, far_ahead += TILE_N * 64) {
    for (int c = 0; c < TILE_N; ++c) _mm_prefetch(ahead + c * 64, _MM_HINT_T0);
    for (int c = 0; c < TILE_N; ++c) _mm_prefetch(far_ahead + c * 64, _MM_HINT_T1);
    tile_step<scalar_t, R>(x, k, wj, t, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) y[r * n + j + c] = scalar_t(_mm512_reduce_add_ps(acc[r][c]));
}

template <typename scalar_t>
void vector_rows(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t m, int64_t n, int64_t k,
                 int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; j += TILE_N) {
    for (int64_t i = 0; i < m; i += ROWS) {  // the tile stays in L1 between passes
      const scalar_t* xi = x + i * k;
      scalar_t* yi = y + i * n;
      switch (std::min<int64_t>(ROWS, m - i)) {
        case 1: tile<scalar_t, 1>(xi, w, yi, n, k, j); break;
        case 2: tile<scalar_t, 2>(xi, w, yi, n, k, j); break;
        case 3: tile<scalar_t, 3>(xi, w, yi, n, k, j); break;
        default: tile<scalar_t, 4>(xi, w, yi, n, k, j); break;
      }
    }
  }
}
#endif

}  // namespace

// True when skinny_linear runs the register-tiled AVX-512 path for this dtype (and a K that fits).
static bool skinny_vectorised(at::ScalarType dtype) {
#if defined(__AVX512F__)
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
#if defined(__AVX512F__)
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
