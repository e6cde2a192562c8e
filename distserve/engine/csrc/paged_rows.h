// What the tiled paged decode attention kernels share whatever their vector width
// (decode_attention_avx512.h's loop, decode_attention_avx2.cpp): the op's argument checks, the cache
// layout they read, each key's row offset through the block table, and the L2 prefetch of rows.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace paged_rows {

struct Layout {
  int64_t heads, kv_heads, block_size, plane;  // plane: elements from K's to V's half of the layer
};

// The decode attention op's arguments, checked (q and cache in `dtype`, head_dim 64 or 128, one block
// table and one length >= 1 per query), with the tables and lengths as contiguous int64.
struct Checked {
  at::Tensor tables, lens;
  Layout layout;
};

inline Checked check_args(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, at::ScalarType dtype) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && cache.is_contiguous() && q.is_contiguous(), "bad q/cache");
  TORCH_CHECK(q.scalar_type() == dtype && cache.scalar_type() == dtype, "q and cache must be ", dtype);
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128, "head_dim must be 64 or 128");
  TORCH_CHECK(q.size(1) % cache.size(3) == 0 && cache.size(4) == d, "q and cache heads do not match");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(lens.numel() == q.size(0) && tables.size(0) == q.size(0), "one block table and length per query");
  const int64_t* len_ptr = lens.data_ptr<int64_t>();  // read in place: min().item() cost ~1 us a layer
  TORCH_CHECK(std::all_of(len_ptr, len_ptr + lens.numel(), [](int64_t n) { return n > 0; }),
              "every sequence needs at least one key");
  return {tables, lens, Layout{q.size(1), cache.size(3), cache.size(2), cache.stride(0)}};
}

// rows[t] = element offset, in one plane, of the row (all KV heads, `row` elements) of key start + t.
inline void key_rows(const int64_t* table, int64_t start, int64_t n, const Layout& l, int64_t row,
                     std::vector<int64_t>& rows) {
  rows.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = start + t;
    rows[t] = (table[pos / l.block_size] * l.block_size + pos % l.block_size) * row;
  }
}

// Prefetches the rows (all KV heads) of keys [t0, t1) of one plane into L2. At bf16 batch 32 this took
// the AVX-512 kernel from ~6 to ~9 GB/s, about what a plain read of random 8 KB chunks reaches there.
template <typename elem>
inline void prefetch_rows(const elem* plane, const int64_t* rows, int64_t t0, int64_t t1, int64_t row_bytes) {
  for (int64_t t = t0; t < t1; ++t) {
    const char* p = reinterpret_cast<const char*>(plane + rows[t]);
    for (int64_t offset = 0; offset < row_bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T1);
  }
}

}  // namespace paged_rows
