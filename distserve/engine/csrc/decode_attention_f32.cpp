// Paged decode attention for float32 on CPUs with AVX-512 (the shared tile loop and the op's
// contract: decode_attention_avx512.h).
//
// A score is D / 16 fused multiply-adds per key and head; the weighted sum of V is one fused
// multiply-add per 16 dims, key and head, with P kept in float32 (no rounding anywhere but the sums'
// order). The generic kernel (paged_attention.cpp) sums each dot product with scalar code: at float32
// batch 32-64 its attention was ~40% of a decode step.
#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include "decode_attention_avx512.h"

namespace {

using namespace decode_attention;

struct F32Ops {
  using elem = float;
  using prob = float;

  // scores[0 .. 16) = scale * q . k[t0 + j, g] for query head q; keys past count: MASKED.
  template <int D>
  static void score_tile(const float* q, const float* keys, const int64_t* rows, int64_t t0, int64_t count,
                         int64_t g, __m512 scale, float* scores) {
    constexpr int CH = D / 16;  // zmm of 16 floats per head
    __m512 qv[CH];
    for (int i = 0; i < CH; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
    __m512 partial[KB];
    for (int64_t j = 0; j < KB; ++j) {
      // Two chains, so a key's fused multiply-adds are not one serial dependency.
      __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
      if (j < count) {
        const float* k = keys + rows[t0 + j] + g * D;
        for (int i = 0; i < CH; i += 2) {
          even = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), even);
          odd = _mm512_fmadd_ps(qv[i + 1], _mm512_loadu_ps(k + 16 * (i + 1)), odd);
        }
      }
      partial[j] = _mm512_add_ps(even, odd);
    }
    store_scores(partial, count, scale, scores);
  }

  static const float* to_probs(const float* p, int64_t, std::vector<float>&) { return p; }  // P stays float32

  // acc[hh] += sum over t in [t0, t1) of p[h0 + hh][t] * v[t, g]. acc: [H][D] float32.
  template <int D, int NH>
  static void weigh_tile(const float* values, const int64_t* rows, int64_t t0, int64_t t1, int64_t g, int64_t h0,
                         const float* probs, int64_t stride, float* acc_out) {
    constexpr int CH = D / 16;
    __m512 acc[NH][CH];
    for (int hh = 0; hh < NH; ++hh)
      for (int i = 0; i < CH; ++i) acc[hh][i] = _mm512_loadu_ps(acc_out + (h0 + hh) * D + 16 * i);
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = values + rows[t] + g * D;
      __m512 p[NH];
      for (int hh = 0; hh < NH; ++hh) p[hh] = _mm512_set1_ps(probs[(h0 + hh) * stride + t]);
      for (int i = 0; i < CH; ++i) {
        const __m512 vi = _mm512_loadu_ps(v + 16 * i);
        for (int hh = 0; hh < NH; ++hh) acc[hh][i] = _mm512_fmadd_ps(p[hh], vi, acc[hh][i]);
      }
    }
    for (int hh = 0; hh < NH; ++hh)
      for (int i = 0; i < CH; ++i) _mm512_storeu_ps(acc_out + (h0 + hh) * D + 16 * i, acc[hh][i]);
  }

  template <int D>
  static void store_head(const float* acc, float inv_sum, float* out) {
    const __m512 inv = _mm512_set1_ps(inv_sum);
    for (int i = 0; i < D / 16; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), inv));
  }
};

at::Tensor paged_decode_attention_f32(at::Tensor q, at::Tensor cache, at::Tensor block_tables, at::Tensor seq_lens,
                                      int64_t window, double scale) {
  return paged_decode_attention<F32Ops>(q, cache, block_tables, seq_lens, window, scale, at::kFloat);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("paged_decode_attention_f32(Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, int window, "
        "float scale) -> Tensor");
  m.impl("paged_decode_attention_f32", c10::DispatchKey::CPU, &paged_decode_attention_f32);
}
#endif
