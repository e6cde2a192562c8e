// Paged decode attention for bfloat16 on CPUs with AVX512-BF16 (the shared tile loop and the op's
// contract: decode_attention_avx512.h).
//
// A score is two or four bf16 dot-product instructions per key and head; the weighted sum of V takes
// two keys per dot-product instruction, with P rounded to bf16 as flash attention rounds it for its
// PV product. The generic kernel (paged_attention.cpp) widened every K and V row to float32 and read
// ~4-7 GB/s from DRAM at batch 32, a third of a decode step; this one ~9.
#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "decode_attention_avx512.h"

namespace {

using namespace decode_attention;

struct Bf16Ops {
  using elem = uint16_t;
  using prob = uint16_t;

  // scores[0 .. 16) = scale * q . k[t0 + j, g] for query head q; keys past count: MASKED.
  template <int D>
  static void score_tile(const uint16_t* q, const uint16_t* keys, const int64_t* rows, int64_t t0, int64_t count,
                         int64_t g, __m512 scale, float* scores) {
    constexpr int CH = D / 32;  // zmm of 32 bf16 per head
    __m512bh qv[CH];
    for (int i = 0; i < CH; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(q + 32 * i);
    __m512 partial[KB];
    for (int64_t j = 0; j < KB; ++j) {
      __m512 acc = _mm512_setzero_ps();
      if (j < count) {
        const uint16_t* k = keys + rows[t0 + j] + g * D;
        for (int i = 0; i < CH; ++i) acc = _mm512_dpbf16_ps(acc, qv[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
      }
      partial[j] = acc;
    }
    store_scores(partial, count, scale, scores);
  }

  // P in bf16 for weigh_tile's pairs: `total` (a multiple of 16) entries into spare.
  static const uint16_t* to_probs(const float* p, int64_t total, std::vector<uint16_t>& spare) {
    spare.resize(total);
    for (int64_t t = 0; t < total; t += KB)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(spare.data() + t),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + t)));
    return spare.data();
  }

  // acc[hh] += sum over t in [t0, t1) of p[h0 + hh][t] * v[t, g], two keys per dot-product instruction:
  // the rows of keys t and t + 1 interleaved (unpacklo/hi) against the pair (p[t], p[t + 1]).
  // acc: [H][2 * D / 32][16] float32 in the unpack order, see store_head.
  template <int D, int NH>
  static void weigh_tile(const uint16_t* values, const int64_t* rows, int64_t t0, int64_t t1, int64_t g, int64_t h0,
                         const uint16_t* probs, int64_t stride, float* acc_out) {
    constexpr int CH = D / 32;
    alignas(64) static const uint16_t zero_row[128] = {};
    __m512 acc[NH][2 * CH];
    for (int hh = 0; hh < NH; ++hh)
      for (int i = 0; i < 2 * CH; ++i) acc[hh][i] = _mm512_loadu_ps(acc_out + (h0 + hh) * D + 16 * i);
    for (int64_t t = t0; t < t1; t += 2) {
      const uint16_t* va = values + rows[t] + g * D;
      const uint16_t* vb = t + 1 < t1 ? values + rows[t + 1] + g * D : zero_row;  // its p is 0 (masked)
      __m512i pair[NH];
      for (int hh = 0; hh < NH; ++hh)
        pair[hh] = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(probs + (h0 + hh) * stride + t));
      for (int c = 0; c < CH; ++c) {
        const __m512i a = _mm512_loadu_si512(va + 32 * c), b = _mm512_loadu_si512(vb + 32 * c);
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int hh = 0; hh < NH; ++hh) {
          acc[hh][2 * c] = _mm512_dpbf16_ps(acc[hh][2 * c], lo, (__m512bh)pair[hh]);
          acc[hh][2 * c + 1] = _mm512_dpbf16_ps(acc[hh][2 * c + 1], hi, (__m512bh)pair[hh]);
        }
      }
    }
    for (int hh = 0; hh < NH; ++hh)
      for (int i = 0; i < 2 * CH; ++i) _mm512_storeu_ps(acc_out + (h0 + hh) * D + 16 * i, acc[hh][i]);
  }

  // out[d] = acc * inv_sum in bf16, undoing the unpack order: element e of vector 2c + s holds dim
  // 32c + 8 (e / 4) + 4s + e % 4 (unpacklo/hi interleave 4 of each 128-bit lane's 8 dims).
  template <int D>
  static void store_head(const float* acc, float inv_sum, uint16_t* out) {
    alignas(64) float dims[D];
    for (int v = 0; v < 2 * D / 32; ++v)
      for (int e = 0; e < 16; ++e) dims[32 * (v / 2) + 8 * (e / 4) + 4 * (v % 2) + e % 4] = acc[16 * v + e] * inv_sum;
    for (int i = 0; i < D / 16; ++i) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_load_ps(dims + 16 * i));  // nearest even
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * i), (__m256i)rounded);
    }
  }
};

at::Tensor paged_decode_attention_bf16(at::Tensor q, at::Tensor cache, at::Tensor block_tables, at::Tensor seq_lens,
                                       int64_t window, double scale) {
  return paged_decode_attention<Bf16Ops>(q, cache, block_tables, seq_lens, window, scale, at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("paged_decode_attention_bf16(Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, int window, "
        "float scale) -> Tensor");
  m.impl("paged_decode_attention_bf16", c10::DispatchKey::CPU, &paged_decode_attention_bf16);
}
#endif
