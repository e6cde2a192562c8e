// Paged decode attention for CPU: one query token per sequence, reading K/V straight from the
// paged cache through the block table (no gather, no padding).
//
// q:            [B, H, D]                              (float32 or bfloat16)
// cache:        [2, num_blocks + 1, block_size, Hkv, D] one layer of the cache, contiguous, q's dtype
// block_tables: [B, max_blocks] int64
// seq_lens:     [B] int64, keys [max(0, len - window), len) are attended (window 0: all)
// returns       [B, H, D] in q's dtype; softmax and accumulation in float32.
//
// Work is split over sequences. For each token, one contiguous row of all KV heads [Hkv * D] is
// widened to float32 once and used by every query head, so the cache streams through memory in order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "widen.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

struct Shape {
  int64_t heads, kv_heads, head_dim, block_size, kv_plane;
};

// Scratch buffers of one worker thread, reused across sequences.
struct Scratch {
  std::vector<float> q, scores, acc, row;
};

// One sequence: q [H, D] against its `len` cached tokens; writes out [H, D].
template <typename scalar_t>
static void attend_sequence(const scalar_t* q, const scalar_t* cache, const int64_t* table, int64_t start,
                            int64_t len, const Shape& s, float scale, scalar_t* out, Scratch& w) {
  const int64_t n = len - start, group = s.heads / s.kv_heads, d = s.head_dim, row = s.kv_heads * d;
  w.q.resize(s.heads * d);
  w.scores.resize(s.heads * n);
  w.acc.assign(s.heads * d, 0.0f);
  w.row.resize(row);
  widen<scalar_t>(q, w.q.data(), s.heads * d);
  for (auto& x : w.q) x *= scale;
  auto slot = [&](int64_t pos) { return (table[pos / s.block_size] * s.block_size + pos % s.block_size) * row; };
  for (int64_t t = 0; t < n; ++t) {  // scores[h, t] = q[h] . k[t, h / group]
    widen<scalar_t>(cache + slot(start + t), w.row.data(), row);
    for (int64_t h = 0; h < s.heads; ++h) {
      const float* qh = w.q.data() + h * d;
      const float* kh = w.row.data() + (h / group) * d;
      float dot = 0.0f;
      for (int64_t i = 0; i < d; ++i) dot += qh[i] * kh[i];
      w.scores[h * n + t] = dot;
    }
  }
  for (int64_t h = 0; h < s.heads; ++h) {  // softmax over t, in place
    float* sh = w.scores.data() + h * n;
    const float top = *std::max_element(sh, sh + n);
    float total = 0.0f;
    for (int64_t t = 0; t < n; ++t) total += (sh[t] = std::exp(sh[t] - top));
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < n; ++t) sh[t] *= inv;
  }
  for (int64_t t = 0; t < n; ++t) {  // acc[h] += p[h, t] * v[t, h / group]
    widen<scalar_t>(cache + s.kv_plane + slot(start + t), w.row.data(), row);
    for (int64_t h = 0; h < s.heads; ++h) {
      const float p = w.scores[h * n + t];
      const float* vh = w.row.data() + (h / group) * d;
      float* ah = w.acc.data() + h * d;
      for (int64_t i = 0; i < d; ++i) ah[i] += p * vh[i];
    }
  }
  for (int64_t i = 0; i < s.heads * d; ++i) out[i] = scalar_t(w.acc[i]);
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor cache, at::Tensor block_tables, at::Tensor seq_lens,
                                  int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && cache.is_contiguous() && q.is_contiguous(), "bad q/cache");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "cache and q dtypes differ");
  TORCH_CHECK(q.size(1) % cache.size(3) == 0 && q.size(2) == cache.size(4), "q and cache heads do not match");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(lens.numel() == q.size(0) && tables.size(0) == q.size(0), "one block table and length per query");
  const int64_t* lens_ptr = lens.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(lens_ptr, lens_ptr + lens.numel(), [](int64_t n) { return n > 0; }),
              "every sequence needs at least one key");  // softmax over no keys: 0 / 0
  const Shape shape{q.size(1), cache.size(3), q.size(2), cache.size(2), cache.stride(0)};
  const int64_t batch = q.size(0), max_blocks = tables.size(1);
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q_ptr = q.data_ptr<scalar_t>();
    const scalar_t* cache_ptr = cache.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const int64_t* table_ptr = tables.data_ptr<int64_t>();
    const int64_t* len_ptr = lens.data_ptr<int64_t>();
    const int64_t per_seq = shape.heads * shape.head_dim;
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t len = len_ptr[b], start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        attend_sequence<scalar_t>(q_ptr + b * per_seq, cache_ptr, table_ptr + b * max_blocks, start, len, shape,
                                  float(scale), out_ptr + b * per_seq, scratch);
      }
    });
  });
  return out;
}

// Registered as torch.ops.distserve.paged_decode_attention (no pybind11: a lighter, faster build).
TORCH_LIBRARY(distserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, int window, "
        "float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
