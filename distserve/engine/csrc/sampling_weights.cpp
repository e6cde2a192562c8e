// The sampler's weights in two passes per row: the max, then exp and the per-block float64 sums that
// the two-level draw reads (distserve/engine/sampling.py, _draw).
//
// For row s of the output, source row x = rows[s] of src [R, V] (float32) and its scale (1 / temperature):
// weights[s] = exp((x - max(x)) * scale[s]), which is exp(x / T - max(x / T)) up to rounding, with the
// top token at exactly 1 (0 where the exponent is below -87, so a -inf logit weighs exactly 0);
// block_sums[s, k] = the float64 sum of weights[s] over tokens [k * block, (k + 1) * block). A row with a
// NaN or +inf, or only -inf, gets NaN block sums: the draw reports it as that row's error.
//
// torch takes five passes over [S, V] for the same (divide, max, subtract, exp, a float64 sum that first
// widens the whole tensor): ~1.6 ms at 25 x 32k on one core here, ~10% of a decode step's CPU under a
// sampled rate-inf load. Each row is computed alone, so a row's weights do not depend on its batch.
// Built with -ffast-math: NaN and infinity are found from the bits, never by floating-point compares.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#if defined(__AVX512F__)
#include "avx512_math.h"
#else
#include "avx2_math.h"
#endif

namespace {
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kPlusInf = 0x7f800000u;
constexpr uint32_t kMinusInf = 0xff800000u;
constexpr float kExpFloor = -87.0f;  // exp512 clamps here; below it the weight is taken as 0

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// NaN or +inf (a -inf logit is a filtered token, not an error)
inline bool is_bad(float y) {
  const uint32_t b = bits_of(y);
  return (b & kAbsMask) >= kPlusInf && b != kMinusInf;
}

// row_max's end, for both bodies: the scalar tail [i, vocab) past the vector part (whose max is mx and
// verdict bad), then the verdict: false when the row has a NaN or +inf, or only -inf.
bool finish_row_max(const float* x, int64_t vocab, int64_t i, float mx, bool bad, float* out_max) {
  for (; i < vocab; ++i) {
    const float y = x[i];
    bad |= is_bad(y);
    mx = y > mx ? y : mx;
  }
  // every lane -inf leaves the -FLT_MAX start: look for a finite value instead
  bool any_finite = mx > -std::numeric_limits<float>::max();
  if (!any_finite) {
    for (int64_t j = 0; j < vocab && !any_finite; ++j) any_finite = bits_of(x[j]) != kMinusInf;
  }
  *out_max = mx;
  return !bad && any_finite;
}

#if defined(__AVX512F__)
inline __mmask16 bad_lanes(__m512 y) {
  const __m512i b = _mm512_castps_si512(y);
  const __mmask16 nonfinite = _mm512_cmpge_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(kAbsMask)),
                                                      _mm512_set1_epi32(kPlusInf));
  const __mmask16 minus_inf = _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(static_cast<int>(kMinusInf)));
  return nonfinite & static_cast<__mmask16>(~minus_inf);
}

// Pass 1: the row's maximum; false when the row has a NaN or +inf, or only -inf.
bool row_max(const float* x, int64_t vocab, float* out_max) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::max());
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= vocab; i += 16) {
    const __m512 y = _mm512_loadu_ps(x + i);
    bad |= bad_lanes(y);
    m = _mm512_max_ps(m, y);
  }
  return finish_row_max(x, vocab, i, _mm512_reduce_max_ps(m), bad != 0, out_max);
}

// Pass 2: weights and their per-block float64 sums. (x - max) before the scale, so the top token's
// exponent is exactly 0 (a fused x * scale - max would leave its rounding there).
void row_weights(const float* x, float scale, float mx, int64_t vocab, int64_t block, float* w, double* sums) {
  const __m512 s = _mm512_set1_ps(scale), m = _mm512_set1_ps(mx), floor = _mm512_set1_ps(kExpFloor);
  const int64_t num_blocks = (vocab + block - 1) / block;
  for (int64_t k = 0; k < num_blocks; ++k) {
    const int64_t begin = k * block, end = std::min(begin + block, vocab);
    __m512d acc = _mm512_setzero_pd();
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
      const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), m), s);
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, floor, _CMP_GE_OQ), exp512(d));
      _mm512_storeu_ps(w + i, e);
      acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
      acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    double sum = _mm512_reduce_add_pd(acc);
    for (; i < end; ++i) {
      const float d = (x[i] - mx) * scale;
      w[i] = d >= kExpFloor ? std::exp(d) : 0.0f;
      sum += w[i];
    }
    sums[k] = sum;
  }
}

#else  // AVX2 + FMA
inline __m256i bad_lanes(__m256 y) {  // all bits set in the lanes holding a NaN or +inf
  const __m256i b = _mm256_castps_si256(y);
  // |y|'s bits are a non-negative int32: a signed compare with the largest finite value finds NaN and inf
  const __m256i nonfinite = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(kAbsMask)),
                                               _mm256_set1_epi32(static_cast<int>(kPlusInf - 1)));
  const __m256i minus_inf = _mm256_cmpeq_epi32(b, _mm256_set1_epi32(static_cast<int>(kMinusInf)));
  return _mm256_andnot_si256(minus_inf, nonfinite);
}

// Pass 1: the row's maximum; false when the row has a NaN or +inf, or only -inf.
bool row_max(const float* x, int64_t vocab, float* out_max) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::max());
  __m256i bad_v = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= vocab; i += 8) {
    const __m256 y = _mm256_loadu_ps(x + i);
    bad_v = _mm256_or_si256(bad_v, bad_lanes(y));
    m = _mm256_max_ps(m, y);
  }
  return finish_row_max(x, vocab, i, hmax256(m), !_mm256_testz_si256(bad_v, bad_v), out_max);
}

// Pass 2: as the AVX-512 one, 8 lanes at a time.
void row_weights(const float* x, float scale, float mx, int64_t vocab, int64_t block, float* w, double* sums) {
  const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(mx), floor = _mm256_set1_ps(kExpFloor);
  const int64_t num_blocks = (vocab + block - 1) / block;
  for (int64_t k = 0; k < num_blocks; ++k) {
    const int64_t begin = k * block, end = std::min(begin + block, vocab);
    __m256d acc = _mm256_setzero_pd();
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
      const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m), s);
      const __m256 e = _mm256_and_ps(_mm256_cmp_ps(d, floor, _CMP_GE_OQ), exp256(d));
      _mm256_storeu_ps(w + i, e);
      acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
      acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double sum = hsum256d(acc);
    for (; i < end; ++i) {
      const float d = (x[i] - mx) * scale;
      w[i] = d >= kExpFloor ? std::exp(d) : 0.0f;
      sum += w[i];
    }
    sums[k] = sum;
  }
}

#endif

}  // namespace

std::tuple<at::Tensor, at::Tensor> sampling_weights_f32(at::Tensor src, at::Tensor rows, at::Tensor scale,
                                                        int64_t block) {
  TORCH_CHECK(src.dim() == 2 && src.scalar_type() == at::kFloat, "src: [R, V] float32");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows: [S] int64");
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.size(0) == rows.size(0),
              "scale: [S] float32");
  TORCH_CHECK(block > 0, "block must be > 0");
  auto x = src.contiguous();
  auto r = rows.contiguous();
  auto sc = scale.contiguous();
  const int64_t num_rows = r.size(0), vocab = x.size(1), num_blocks = (vocab + block - 1) / block;
  auto weights = at::empty({num_rows, vocab}, x.options());
  auto sums = at::empty({num_rows, num_blocks}, x.options().dtype(at::kDouble));
  const float* in = x.data_ptr<float>();
  const int64_t* row_ids = r.data_ptr<int64_t>();
  const float* scales = sc.data_ptr<float>();
  for (int64_t s = 0; s < num_rows; ++s) TORCH_CHECK(row_ids[s] >= 0 && row_ids[s] < x.size(0), "row out of range");
  float* w = weights.data_ptr<float>();
  double* out_sums = sums.data_ptr<double>();
  at::parallel_for(0, num_rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) {
      const float* row = in + row_ids[s] * vocab;
      float mx;
      if (row_max(row, vocab, &mx)) {
        row_weights(row, scales[s], mx, vocab, block, w + s * vocab, out_sums + s * num_blocks);
      } else {
        std::fill(out_sums + s * num_blocks, out_sums + (s + 1) * num_blocks, std::numeric_limits<double>::quiet_NaN());
      }
    }
  });
  return {weights, sums};
}

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("sampling_weights_f32(Tensor src, Tensor rows, Tensor scale, int block) -> (Tensor, Tensor)");
  m.impl("sampling_weights_f32", c10::DispatchKey::CPU, &sampling_weights_f32);
}
#endif
