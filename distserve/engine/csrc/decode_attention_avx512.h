// The tile-by-tile paged decode attention that the AVX-512 kernels share (decode_attention_bf16.cpp,
// decode_attention_f32.cpp): one query token per sequence against its cached keys, read through the
// block table (no gather, no padding). Included only where __AVX512F__ is defined.
//
// q:            [B, H, D] contiguous, D = 64 or 128
// cache:        [2, num_blocks + 1, block_size, Hkv, D] one layer of the cache, q's dtype, contiguous
// block_tables: [B, max_blocks] int64
// seq_lens:     [B] int64, keys [max(0, len - window), len) are attended (window 0: all)
// returns       [B, H, D] in q's dtype; scores, softmax and the weighted sum in float32.
//
// Why this shape: the generic kernel (paged_attention.cpp) sums each dot product horizontally and
// reads rows one at a time. Here 16 keys' partial dot products are reduced together by one transpose
// tree, and each 16-key tile's rows are prefetched into L2 while the tile before is computed (a
// sequence's blocks lie anywhere in the cache, which the hardware prefetcher does not follow). Both
// passes go tile by tile over every head, so each key row is read whole, once, in order.
//
// An element type plugs in through an Ops struct:
//   elem                         the cache's storage type
//   prob                         the type P is given to weigh_tile in
//   score_tile<D>(...)           16 keys' scaled scores for one query head (see the bf16/f32 files)
//   to_probs(p, total, spare)    P in `prob`: p itself, or converted into spare (resized as needed)
//   weigh_tile<D, NH>(...)       acc += P v over one tile, for NH query heads of one KV head
//   store_head<D>(acc, inv, out) out = acc * inv in elem, undoing weigh_tile's accumulator order
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx512_math.h"
#include "paged_rows.h"

namespace decode_attention {

constexpr int64_t KB = 16;        // keys per tile: one zmm of float32 scores
constexpr float MASKED = -1e30f;  // a finite -inf (built with -ffast-math, which assumes no infinities)
constexpr int64_t AHEAD = KB;     // keys prefetched ahead of the tile computed (2-4 tiles measured no better)

using paged_rows::Layout;
using paged_rows::prefetch_rows;

template <class Ops>
struct Scratch {
  std::vector<int64_t> rows;              // [n] element offset of each key's row (all KV heads) in one plane
  std::vector<float> scores;              // [H][tiles * KB], then the unnormalised probabilities
  std::vector<typename Ops::prob> spare;  // to_probs's output where P changes type (bf16), else unused
  std::vector<float> acc;                 // [H][D] the weighted sums of V, in weigh_tile's order
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

// scores[t0 .. t0 + 16) = scale * the lane sums of partial[j]; keys past `count`: MASKED.
inline void store_scores(const __m512* partial, int64_t count, __m512 scale, float* scores) {
  const __m512 s = _mm512_mul_ps(reduce16(partial), scale);
  _mm512_storeu_ps(scores, _mm512_mask_blend_ps(__mmask16((1u << count) - 1), _mm512_set1_ps(MASKED), s));
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

// One sequence: q [H, D] against keys [start, len) of its block table; writes out [H, D].
template <class Ops, int D>
void attend_sequence(const typename Ops::elem* q, const typename Ops::elem* cache, const int64_t* table,
                     int64_t start, int64_t len, const Layout& l, float scale, typename Ops::elem* out,
                     Scratch<Ops>& w) {
  using elem = typename Ops::elem;
  const int64_t n = len - start, group = l.heads / l.kv_heads, row = l.kv_heads * D;
  const int64_t row_bytes = row * sizeof(elem), padded = (n + KB - 1) / KB * KB;
  paged_rows::key_rows(table, start, n, l, row, w.rows);
  w.scores.resize(l.heads * padded);
  w.acc.assign(l.heads * D, 0.0f);
  const __m512 scale_v = _mm512_set1_ps(scale);
  prefetch_rows(cache, w.rows.data(), 0, std::min<int64_t>(AHEAD, n), row_bytes);
  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    prefetch_rows(cache, w.rows.data(), t0 + AHEAD, std::min<int64_t>(t0 + AHEAD + KB, n), row_bytes);
    for (int64_t h = 0; h < l.heads; ++h)
      Ops::template score_tile<D>(q + h * D, cache, w.rows.data(), t0, std::min<int64_t>(KB, n - t0), h / group,
                                  scale_v, w.scores.data() + h * padded + t0);
  }
  float inv_sum[256];
  TORCH_CHECK(l.heads <= 256, "at most 256 query heads");
  for (int64_t h = 0; h < l.heads; ++h) inv_sum[h] = softmax_unnormalised(w.scores.data() + h * padded, padded);
  const typename Ops::prob* probs = Ops::to_probs(w.scores.data(), l.heads * padded, w.spare);
  const elem* values = cache + l.plane;
  prefetch_rows(values, w.rows.data(), 0, std::min<int64_t>(AHEAD, n), row_bytes);
  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    const int64_t t1 = std::min<int64_t>(t0 + KB, n);
    prefetch_rows(values, w.rows.data(), t0 + AHEAD, std::min<int64_t>(t0 + AHEAD + KB, n), row_bytes);
    for (int64_t g = 0; g < l.kv_heads; ++g) {
      int64_t h = g * group;
      for (; h + 2 <= (g + 1) * group; h += 2)
        Ops::template weigh_tile<D, 2>(values, w.rows.data(), t0, t1, g, h, probs, padded, w.acc.data());
      if (h < (g + 1) * group)
        Ops::template weigh_tile<D, 1>(values, w.rows.data(), t0, t1, g, h, probs, padded, w.acc.data());
    }
  }
  for (int64_t h = 0; h < l.heads; ++h) Ops::template store_head<D>(w.acc.data() + h * D, inv_sum[h], out + h * D);
}

template <class Ops, int D>
void run(const typename Ops::elem* q, const typename Ops::elem* cache, const int64_t* tables, const int64_t* lens,
         int64_t batch, int64_t max_blocks, int64_t window, const Layout& l, float scale, typename Ops::elem* out) {
  const int64_t per_seq = l.heads * D;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    Scratch<Ops> scratch;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b], start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      attend_sequence<Ops, D>(q + b * per_seq, cache, tables + b * max_blocks, start, len, l, scale,
                              out + b * per_seq, scratch);
    }
  });
}

// The op: checks its arguments (the cache and q in `dtype`, stored as Ops::elem) and runs.
template <class Ops>
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor cache, at::Tensor block_tables, at::Tensor seq_lens,
                                  int64_t window, double scale, at::ScalarType dtype) {
  const auto [tables, lens, layout] = paged_rows::check_args(q, cache, block_tables, seq_lens, dtype);
  const int64_t d = q.size(2);
  auto out = at::empty_like(q);
  using elem = typename Ops::elem;
  const auto* q_ptr = static_cast<const elem*>(q.data_ptr());
  const auto* cache_ptr = static_cast<const elem*>(cache.data_ptr());
  auto* out_ptr = static_cast<elem*>(out.data_ptr());
  const int64_t batch = q.size(0), max_blocks = tables.size(1);
  auto go = d == 64 ? &run<Ops, 64> : &run<Ops, 128>;
  go(q_ptr, cache_ptr, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), batch, max_blocks, window, layout,
     float(scale), out_ptr);
  return out;
}

}  // namespace decode_attention
