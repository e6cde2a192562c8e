// Paged decode attention for CPU: one query token per sequence, reading K/V straight from the
// paged cache through the block table (no gather, no padding).
//
// q:            [B, H, D]                              (float32 or bfloat16)
// cache:        [2, num_blocks + 1, block_size, Hkv, D] one layer of the cache, contiguous, q's dtype
// block_tables: [B, max_blocks] int64
// seq_lens:     [B] int64, keys [max(0, len - window), len) are attended (window 0: all)
// returns       [B, H, D] in q's dtype; softmax and accumulation in float32.
//
// Work is split over (sequence, KV head) pairs; each pair handles its G = H / Hkv query heads
// together, so every K/V row is read once for all of them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

template <typename scalar_t>
static void attend_one(const scalar_t* q, const scalar_t* cache, const int64_t* table, int64_t len,
                       int64_t start, int64_t kv_plane, int64_t block_size, int64_t kv_heads, int64_t h,
                       int64_t group, int64_t head_dim, float scale, scalar_t* out,
                       std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t n = len - start;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = float(q[g * head_dim + d]) * scale;
  scores.resize(group * n);
  std::fill(acc.begin(), acc.end(), 0.0f);
  const int64_t row = kv_heads * head_dim;  // elements between consecutive tokens in a block
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = start + t;
    const scalar_t* k = cache + (table[pos / block_size] * block_size + pos % block_size) * row + h * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * head_dim;
      float s = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * float(k[d]);
      scores[g * n + t] = s;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * n;
    const float top = *std::max_element(sg, sg + n);
    float total = 0.0f;
    for (int64_t t = 0; t < n; ++t) total += (sg[t] = std::exp(sg[t] - top));
    for (int64_t t = 0; t < n; ++t) sg[t] /= total;
  }
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = start + t;
    const scalar_t* v = cache + kv_plane + (table[pos / block_size] * block_size + pos % block_size) * row
                        + h * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + t];
      float* ag = acc.data() + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * float(v[d]);
    }
  }
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = scalar_t(acc[i]);
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor cache, at::Tensor block_tables,
                                     at::Tensor seq_lens, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && cache.is_contiguous() && q.is_contiguous(), "bad q/cache");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "cache and q dtypes differ");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = cache.size(2), kv_heads = cache.size(3);
  const int64_t kv_plane = cache.stride(0), max_blocks = tables.size(1);
  const int64_t group = heads / kv_heads;
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q_ptr = q.data_ptr<scalar_t>();
    const scalar_t* cache_ptr = cache.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const int64_t* table_ptr = tables.data_ptr<int64_t>();
    const int64_t* len_ptr = lens.data_ptr<int64_t>();
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(group * head_dim), scores, acc(group * head_dim);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / kv_heads, h = i % kv_heads, len = len_ptr[b];
        const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        const int64_t offset = (b * heads + h * group) * head_dim;
        attend_one<scalar_t>(q_ptr + offset, cache_ptr, table_ptr + b * max_blocks, len, start, kv_plane,
                             block_size, kv_heads, h, group, head_dim, float(scale), out_ptr + offset, qf, scores,
                             acc);
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
