// Paged decode attention for bfloat16 on CPUs with AVX512-BF16: one query token per sequence
// against its cached keys, read through the block table (no gather, no padding).
//
// q:            [B, H, D] bfloat16, contiguous, D = 64 or 128
// cache:        [2, num_blocks + 1, block_size, Hkv, D] one layer of the cache, bfloat16, contiguous
// block_tables: [B, max_blocks] int64
// seq_lens:     [B] int64, keys [max(0, len - window), len) are attended (window 0: all)
// returns       [B, H, D] bfloat16; scores, softmax and the weighted sum in float32.
//
// Why: the generic kernel (paged_attention.cpp) widens every K and V row to float32 and sums each
// dot product horizontally: ~4-7 GB/s from DRAM at batch 32, a third of a decode step. Here a score
// is two or four bf16 dot-product instructions, with 16 keys' partial sums reduced together by a
// transpose tree (no per-key horizontal sum); the weighted sum of V takes two keys per dot-product
// instruction; and each 16-key tile's rows are prefetched into L2 while the tile before is computed.
// Both passes go tile by tile over every head, so each key row is read whole, once, in order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "avx512_math.h"

namespace {

constexpr int64_t KB = 16;               // keys per tile: one zmm of float32 scores
constexpr float MASKED = -1e30f;         // a finite -inf (built with -ffast-math, which assumes no infinities)

struct Scratch {
  std::vector<int64_t> rows;   // [n] element offset of each key's row (all KV heads) in one plane
  std::vector<float> scores;   // [H][tiles * KB], then the unnormalised probabilities
  std::vector<uint16_t> probs; // [H][tiles * KB] the probabilities rounded to bf16
  std::vector<float> acc;      // [H][D] the weighted sums of V, in weigh_tile's order
};

// r[j] = sum of the 16 lanes of v[j], for 16 vectors at once (a transpose-and-add tree).
inline __m512 reduce16(const __m512* v) {
  __m512 a[8], b[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of v[2k], v[2k+1]
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: that lane's sum of v[4k + j] in element j
    const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Sum the four 128-bit lanes of each b[k] into lane k of the result.
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// Prefetches the rows (all KV heads) of keys [t0, t1) of one plane into L2. A sequence's blocks lie
// anywhere in the cache (8 KB of K, 8 KB of V per block and layer here), which the hardware
// prefetcher does not follow: at batch 32 this took the kernel from ~6 to ~9 GB/s, about what a
// plain read of random 8 KB chunks reaches on this machine.
inline void prefetch_rows(const uint16_t* plane, const int64_t* rows, int64_t t0, int64_t t1, int64_t row_bytes) {
  for (int64_t t = t0; t < t1; ++t) {
    const char* p = reinterpret_cast<const char*>(plane + rows[t]);
    for (int64_t offset = 0; offset < row_bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T1);
  }
}

// scores[t0 .. t0 + 16) of query head h = scale * q[h] . k[t, g]; keys past n: MASKED.
template <int D>
void score_tile(const uint16_t* qh, const uint16_t* keys, const int64_t* rows, int64_t t0, int64_t count, int64_t g,
                __m512 scale, float* scores) {
  constexpr int CH = D / 32;  // zmm of 32 bf16 per head
  __m512bh qv[CH];
  for (int i = 0; i < CH; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(qh + 32 * i);
  __m512 partial[KB];
  for (int64_t j = 0; j < KB; ++j) {
    __m512 acc = _mm512_setzero_ps();
    if (j < count) {
      const uint16_t* k = keys + rows[t0 + j] + g * D;
      for (int i = 0; i < CH; ++i) acc = _mm512_dpbf16_ps(acc, qv[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
    }
    partial[j] = acc;
  }
  const __m512 s = _mm512_mul_ps(reduce16(partial), scale);
  _mm512_storeu_ps(scores + t0, _mm512_mask_blend_ps(__mmask16((1u << count) - 1), _mm512_set1_ps(MASKED), s));
}

// In place: scores -> exp(scores - max) over `padded` (a multiple of 16) entries; returns 1 / their sum.
inline float softmax_unnormalised(float* s, int64_t padded) {
  __m512 top = _mm512_set1_ps(MASKED);
  for (int64_t t = 0; t < padded; t += KB) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
  const __m512 top_v = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += KB) {
    const __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), top_v));  // masked keys: ~1e-38
    _mm512_storeu_ps(s + t, p);
    total = _mm512_add_ps(total, p);
  }
  return 1.0f / _mm512_reduce_add_ps(total);
}

// acc[hh] += sum over t in [t0, t1) of p[h0 + hh][t] * v[t, g], for NH query heads h0.. of KV head g,
// two keys per bf16 dot-product instruction: the rows of keys t and t + 1 interleaved (unpacklo/hi),
// against the pair (p[t], p[t + 1]) in bf16, as flash attention rounds P for its PV product.
// acc: [H][2 * D / 32][16] float32 in the unpack order, see store_head.
template <int D, int NH>
void weigh_tile(const uint16_t* values, const int64_t* rows, int64_t t0, int64_t t1, int64_t g, int64_t h0,
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
void store_head(const float* acc, float inv_sum, uint16_t* out) {
  alignas(64) float dims[D];
  for (int v = 0; v < 2 * D / 32; ++v)
    for (int e = 0; e < 16; ++e) dims[32 * (v / 2) + 8 * (e / 4) + 4 * (v % 2) + e % 4] = acc[16 * v + e] * inv_sum;
  for (int i = 0; i < D / 16; ++i) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_load_ps(dims + 16 * i));  // nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * i), (__m256i)rounded);
  }
}

// The probabilities of one head in bf16, for weigh_tile's pairs: [padded] (an even count).
inline void round_probs(const float* p, int64_t padded, uint16_t* out) {
  for (int64_t t = 0; t < padded; t += KB)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + t)));
}

struct Layout {
  int64_t heads, kv_heads, block_size, plane;  // plane: elements from K's to V's half of the layer
};

// One sequence: q [H, D] against keys [start, len) of its block table; writes out [H, D].
template <int D>
void attend_sequence(const uint16_t* q, const uint16_t* cache, const int64_t* table, int64_t start, int64_t len,
                     const Layout& l, float scale, uint16_t* out, Scratch& w) {
  const int64_t n = len - start, group = l.heads / l.kv_heads, row = l.kv_heads * D, row_bytes = row * 2;
  const int64_t padded = (n + KB - 1) / KB * KB;
  w.rows.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = start + t;
    w.rows[t] = (table[pos / l.block_size] * l.block_size + pos % l.block_size) * row;
  }
  w.scores.resize(l.heads * padded);
  w.acc.assign(l.heads * D, 0.0f);
  const __m512 scale_v = _mm512_set1_ps(scale);
  prefetch_rows(cache, w.rows.data(), 0, std::min<int64_t>(KB, n), row_bytes);
  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    prefetch_rows(cache, w.rows.data(), t0 + KB, std::min<int64_t>(t0 + 2 * KB, n), row_bytes);
    for (int64_t h = 0; h < l.heads; ++h)
      score_tile<D>(q + h * D, cache, w.rows.data(), t0, std::min<int64_t>(KB, n - t0), h / group, scale_v,
                    w.scores.data() + h * padded);
  }
  float inv_sum[256];
  TORCH_CHECK(l.heads <= 256, "at most 256 query heads");
  w.probs.resize(l.heads * padded);
  for (int64_t h = 0; h < l.heads; ++h) {
    inv_sum[h] = softmax_unnormalised(w.scores.data() + h * padded, padded);
    round_probs(w.scores.data() + h * padded, padded, w.probs.data() + h * padded);
  }
  const uint16_t* values = cache + l.plane;
  prefetch_rows(values, w.rows.data(), 0, std::min<int64_t>(KB, n), row_bytes);
  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    const int64_t t1 = std::min<int64_t>(t0 + KB, n);
    prefetch_rows(values, w.rows.data(), t1, std::min<int64_t>(t1 + KB, n), row_bytes);
    for (int64_t g = 0; g < l.kv_heads; ++g) {
      int64_t h = g * group;
      for (; h + 2 <= (g + 1) * group; h += 2)
        weigh_tile<D, 2>(values, w.rows.data(), t0, t1, g, h, w.probs.data(), padded, w.acc.data());
      if (h < (g + 1) * group)
        weigh_tile<D, 1>(values, w.rows.data(), t0, t1, g, h, w.probs.data(), padded, w.acc.data());
    }
  }
  for (int64_t h = 0; h < l.heads; ++h) store_head<D>(w.acc.data() + h * D, inv_sum[h], out + h * D);
}

template <int D>
void run(const uint16_t* q, const uint16_t* cache, const int64_t* tables, const int64_t* lens, int64_t batch,
         int64_t max_blocks, int64_t window, const Layout& l, float scale, uint16_t* out) {
  const int64_t per_seq = l.heads * D;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b], start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      attend_sequence<D>(q + b * per_seq, cache, tables + b * max_blocks, start, len, l, scale, out + b * per_seq,
                         scratch);
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention_bf16(at::Tensor q, at::Tensor cache, at::Tensor block_tables, at::Tensor seq_lens,
                                       int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && cache.is_contiguous() && q.is_contiguous(), "bad q/cache");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && cache.scalar_type() == at::kBFloat16, "bfloat16 only");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "head_dim must be 64 or 128");
  TORCH_CHECK(q.size(1) % cache.size(3) == 0 && cache.size(4) == d, "q and cache heads do not match");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(lens.numel() == q.size(0) && tables.size(0) == q.size(0), "one block table and length per query");
  TORCH_CHECK(lens.numel() == 0 || lens.min().item<int64_t>() > 0, "every sequence needs at least one key");
  const Layout layout{q.size(1), cache.size(3), cache.size(2), cache.stride(0)};
  auto out = at::empty_like(q);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* cache_ptr = reinterpret_cast<const uint16_t*>(cache.data_ptr<at::BFloat16>());
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t batch = q.size(0), max_blocks = tables.size(1);
  if (d == 64)
    run<64>(q_ptr, cache_ptr, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), batch, max_blocks, window, layout,
            float(scale), out_ptr);
  else
    run<128>(q_ptr, cache_ptr, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), batch, max_blocks, window,
             layout, float(scale), out_ptr);
  return out;
}

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("paged_decode_attention_bf16(Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, int window, "
        "float scale) -> Tensor");
  m.impl("paged_decode_attention_bf16", c10::DispatchKey::CPU, &paged_decode_attention_bf16);
}
#endif
