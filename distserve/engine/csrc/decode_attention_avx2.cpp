// Paged decode attention for float32 on CPUs with AVX2 + FMA and no AVX-512 (AMD Zen 2/3, older
// Xeons): the same op, torch.ops.distserve.paged_decode_attention_f32, and the same plan as the
// AVX-512 kernel (decode_attention_avx512.h: its contract, and why tiles and prefetching), with tiles
// of 8 keys, one ymm of float32 scores.
//
// q:            [B, H, D] float32 contiguous, D = 64 or 128
// cache:        [2, num_blocks + 1, block_size, Hkv, D] one layer of the cache, float32, contiguous
// block_tables: [B, max_blocks] int64
// seq_lens:     [B] int64, keys [max(0, len - window), len) are attended (window 0: all)
// returns       [B, H, D] float32
//
// Why not the generic kernel (paged_attention.cpp) here: it reduces each dot product on its own and
// reads rows as the block table lists them, with no prefetch: on one core of an AMD EPYC (Zen 3),
// attention was a third of a float32 decode step at batch 32, 300 tokens of context.
// AVX2 has 16 vector registers, so q is read from L1 rather than held in registers, and P V goes
// over 32 dims at a time (NH heads x 4 accumulators, 4 values and NH probabilities in registers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx2_math.h"
#include "paged_rows.h"

namespace {

constexpr int64_t KB = 8;         // keys per tile: one ymm of float32 scores
constexpr float MASKED = -1e30f;  // a finite -inf (built with -ffast-math, which assumes no infinities)
constexpr int64_t AHEAD = 16;     // keys prefetched ahead of the tile computed
constexpr int DIMS_STEP = 4;      // ymm of dims per pass of weigh_tile

using paged_rows::Layout;
using paged_rows::prefetch_rows;

struct Scratch {
  std::vector<int64_t> rows;   // [n] element offset of each key's row (all KV heads) in one plane
  std::vector<float> scores;   // [H][tiles * KB], then the unnormalised probabilities
  std::vector<float> acc;      // [H][D] the weighted sums of V
};

// scores[0 .. 8) = scale * q . k[t0 + j, g] for one query head; keys past count: MASKED.
template <int D>
void score_tile(const float* q, const float* keys, const int64_t* rows, int64_t t0, int64_t count, int64_t g,
                __m256 scale, float* scores) {
  constexpr int CH = D / 8;  // ymm of 8 floats per head
  __m256 partial[KB];
  for (int64_t j = 0; j < KB; ++j) {
    // Two chains, so a key's fused multiply-adds are not one serial dependency.
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    if (j < count) {
      const float* k = keys + rows[t0 + j] + g * D;
      for (int i = 0; i < CH; i += 2) {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), _mm256_loadu_ps(k + 8 * i), even);
        odd = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * (i + 1)), _mm256_loadu_ps(k + 8 * (i + 1)), odd);
      }
    }
    partial[j] = _mm256_add_ps(even, odd);
  }
  const __m256 s = _mm256_mul_ps(reduce8(partial), scale);
  _mm256_storeu_ps(scores, _mm256_blendv_ps(_mm256_set1_ps(MASKED), s, first_lanes(count)));
}

// acc[hh] += sum over t in [t0, t1) of p[h0 + hh][t] * v[t, g], DIMS_STEP ymm of dims at a time.
template <int D, int NH>
void weigh_tile(const float* values, const int64_t* rows, int64_t t0, int64_t t1, int64_t g, int64_t h0,
                const float* probs, int64_t stride, float* acc_out) {
  for (int c0 = 0; c0 < D / 8; c0 += DIMS_STEP) {
    __m256 acc[NH][DIMS_STEP];
    for (int hh = 0; hh < NH; ++hh)
      for (int i = 0; i < DIMS_STEP; ++i) acc[hh][i] = _mm256_loadu_ps(acc_out + (h0 + hh) * D + 8 * (c0 + i));
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = values + rows[t] + g * D + 8 * c0;
      __m256 p[NH];
      for (int hh = 0; hh < NH; ++hh) p[hh] = _mm256_set1_ps(probs[(h0 + hh) * stride + t]);
      for (int i = 0; i < DIMS_STEP; ++i) {
        const __m256 vi = _mm256_loadu_ps(v + 8 * i);
        for (int hh = 0; hh < NH; ++hh) acc[hh][i] = _mm256_fmadd_ps(p[hh], vi, acc[hh][i]);
      }
    }
    for (int hh = 0; hh < NH; ++hh)
      for (int i = 0; i < DIMS_STEP; ++i) _mm256_storeu_ps(acc_out + (h0 + hh) * D + 8 * (c0 + i), acc[hh][i]);
  }
}

// In place: scores -> exp(scores - max) over `padded` (a multiple of 8) entries; returns 1 / their sum.
inline float softmax_unnormalised(float* s, int64_t padded) {
  __m256 top = _mm256_set1_ps(MASKED);
  for (int64_t t = 0; t < padded; t += KB) top = _mm256_max_ps(top, _mm256_loadu_ps(s + t));
  const __m256 top_v = _mm256_set1_ps(hmax256(top));
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += KB) {
    const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), top_v));  // masked keys: ~1e-38
    _mm256_storeu_ps(s + t, p);
    total = _mm256_add_ps(total, p);
  }
  return 1.0f / hsum256(total);
}

// One sequence: q [H, D] against keys [start, len) of its block table; writes out [H, D].
template <int D>
void attend_sequence(const float* q, const float* cache, const int64_t* table, int64_t start, int64_t len,
                     const Layout& l, float scale, float* out, Scratch& w) {
  const int64_t n = len - start, group = l.heads / l.kv_heads, row = l.kv_heads * D;
  const int64_t row_bytes = row * int64_t(sizeof(float)), padded = (n + KB - 1) / KB * KB;
  paged_rows::key_rows(table, start, n, l, row, w.rows);
  w.scores.resize(l.heads * padded);
  w.acc.assign(l.heads * D, 0.0f);
  const __m256 scale_v = _mm256_set1_ps(scale);
  prefetch_rows(cache, w.rows.data(), 0, std::min<int64_t>(AHEAD, n), row_bytes);
  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    prefetch_rows(cache, w.rows.data(), std::min(t0 + AHEAD, n), std::min<int64_t>(t0 + AHEAD + KB, n), row_bytes);
    for (int64_t h = 0; h < l.heads; ++h)
      score_tile<D>(q + h * D, cache, w.rows.data(), t0, std::min<int64_t>(KB, n - t0), h / group, scale_v,
                    w.scores.data() + h * padded + t0);
  }
  float inv_sum[256];
  TORCH_CHECK(l.heads <= 256, "at most 256 query heads");
  for (int64_t h = 0; h < l.heads; ++h) inv_sum[h] = softmax_unnormalised(w.scores.data() + h * padded, padded);
  const float* values = cache + l.plane;
  prefetch_rows(values, w.rows.data(), 0, std::min<int64_t>(AHEAD, n), row_bytes);
  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    const int64_t t1 = std::min<int64_t>(t0 + KB, n);
    prefetch_rows(values, w.rows.data(), std::min(t0 + AHEAD, n), std::min<int64_t>(t0 + AHEAD + KB, n), row_bytes);
    for (int64_t g = 0; g < l.kv_heads; ++g) {
      int64_t h = g * group;
      for (; h + 2 <= (g + 1) * group; h += 2)
        weigh_tile<D, 2>(values, w.rows.data(), t0, t1, g, h, w.scores.data(), padded, w.acc.data());
      if (h < (g + 1) * group) weigh_tile<D, 1>(values, w.rows.data(), t0, t1, g, h, w.scores.data(), padded, w.acc.data());
    }
  }
  for (int64_t h = 0; h < l.heads; ++h) {
    const __m256 inv = _mm256_set1_ps(inv_sum[h]);
    for (int i = 0; i < D / 8; ++i)
      _mm256_storeu_ps(out + h * D + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(w.acc.data() + h * D + 8 * i), inv));
  }
}

template <int D>
void run(const float* q, const float* cache, const int64_t* tables, const int64_t* lens, int64_t batch,
         int64_t max_blocks, int64_t window, const Layout& l, float scale, float* out) {
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

at::Tensor paged_decode_attention_f32(at::Tensor q, at::Tensor cache, at::Tensor block_tables, at::Tensor seq_lens,
                                      int64_t window, double scale) {
  const auto [tables, lens, layout] = paged_rows::check_args(q, cache, block_tables, seq_lens, at::kFloat);
  const int64_t d = q.size(2);
  auto out = at::empty_like(q);
  auto go = d == 64 ? &run<64> : &run<128>;
  go(q.data_ptr<float>(), cache.data_ptr<float>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), q.size(0), tables.size(1),
     window, layout, float(scale), out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("paged_decode_attention_f32(Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, int window, "
        "float scale) -> Tensor");
  m.impl("paged_decode_attention_f32", c10::DispatchKey::CPU, &paged_decode_attention_f32);
}
#endif
