// Causal float32 prefill attention on CPUs with AVX2 + FMA and no AVX-512 (AMD Zen 2/3, older Xeons):
// the same op, torch.ops.distserve.prefill_attention_f32, and the same three passes as the AVX-512
// kernel (prefill_attention.cpp: its contract and why), with tiles of 8 keys (one ymm of scores).
//
// q:      [n, H, D] float32, contiguous; a chunk of n prompt tokens at positions [position, position + n)
// kv:     [2, T, Hkv, D] float32, one layer of the prompt's KV buffer (this chunk's K/V already in it)
// window: 0, or a sliding window (query at p sees keys (p - window, p])
// returns [n, H * D] float32
//
// AVX2 has 16 vector registers: QB = 8 query rows share each K tile in the score pass (8 accumulators,
// the tile and a broadcast), and P V goes over 4 rows by 16 dims at a time (8 accumulators, 2 values,
// a broadcast), V read in place from the KV buffer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "avx2_math.h"

namespace {

constexpr int64_t KB = 8;  // keys per tile: one ymm of float32 scores
constexpr int QB = 8;      // query rows per pass
constexpr int RG = 4;      // rows per P V accumulator group
constexpr int DG = 2;      // ymm of dims per P V accumulator group

// One KV head's K as tiles [blocks][D][KB] (zero past the last key); V row of key j at v + j * v_stride.
struct PackedHead {
  std::vector<float> k;
  const float* v = nullptr;
  int64_t v_stride = 0;
};

void pack_head(const float* kv, int64_t end, int64_t kv_heads, int64_t g, int64_t plane, int64_t d, PackedHead& out) {
  const int64_t row = kv_heads * d;
  out.k.assign((end + KB - 1) / KB * d * KB, 0.0f);
  for (int64_t j = 0; j < end; ++j) {
    const float* key = kv + j * row + g * d;
    float* tile = out.k.data() + (j / KB) * d * KB + j % KB;
    for (int64_t p = 0; p < d; ++p) tile[p * KB] = key[p];
  }
  out.v = kv + plane + g * d;
  out.v_stride = row;
}

// out[r][0 .. 16) = sum over keys [first, last] of P[r0 + r][key] * V[key][8 c0 .. 8 c0 + 16), r < RG.
// Eight named accumulators: as an array (through the caller's reference, or a local one) gcc stored all
// eight to memory on every key, 8 stores per 8 fused multiply-adds, and this pass ran ~2x its FMA bound.
template <int D>
void weigh_rows(const PackedHead& head, int64_t first, int64_t last, const float* probs, int64_t stride, int r0,
                int c0, __m256 (&out)[RG][DG]) {
  static_assert(RG == 4 && DG == 2, "the accumulators below are written out for 4 rows by 2 ymm");
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  const float* row = head.v + first * head.v_stride + 8 * c0;
  const float* p0 = probs + r0 * stride;
  const float *p1 = p0 + stride, *p2 = p1 + stride, *p3 = p2 + stride;
  for (int64_t j = 0; j <= last - first; ++j, row += head.v_stride) {
    const __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
    __m256 p = _mm256_broadcast_ss(p0 + j);
    a00 = _mm256_fmadd_ps(p, v0, a00), a01 = _mm256_fmadd_ps(p, v1, a01);
    p = _mm256_broadcast_ss(p1 + j);
    a10 = _mm256_fmadd_ps(p, v0, a10), a11 = _mm256_fmadd_ps(p, v1, a11);
    p = _mm256_broadcast_ss(p2 + j);
    a20 = _mm256_fmadd_ps(p, v0, a20), a21 = _mm256_fmadd_ps(p, v1, a21);
    p = _mm256_broadcast_ss(p3 + j);
    a30 = _mm256_fmadd_ps(p, v0, a30), a31 = _mm256_fmadd_ps(p, v1, a31);
  }
  out[0][0] = a00, out[0][1] = a01, out[1][0] = a10, out[1][1] = a11;
  out[2][0] = a20, out[2][1] = a21, out[3][0] = a30, out[3][1] = a31;
}

// QB consecutive queries of one head (positions pos0 .. pos0 + count - 1) against one packed KV head.
template <int D>
void attend_queries(const float* q, int64_t q_stride, int64_t count, int64_t pos0, int64_t window, float scale,
                    const PackedHead& head, std::vector<float>& scratch, float* out, int64_t out_stride) {
  static_assert(DG == 2 && D % (8 * DG) == 0 && QB % RG == 0, "tile shapes");
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  alignas(32) float qs[QB][D];
  for (int r = 0; r < QB; ++r)
    for (int p = 0; p < D; ++p) qs[r][p] = r < count ? q[r * q_stride + p] : 0.0f;
  const int64_t last = pos0 + count - 1;  // the last query's position: no key beyond it is read
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) / KB * KB : 0;
  const int64_t span = (last / KB + 1) * KB - first_key;  // whole tiles
  scratch.resize(QB * span);
  float* scores = scratch.data();  // [QB][span]: scores, then probabilities in place
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 scale_v = _mm256_set1_ps(scale), neg_inf = _mm256_set1_ps(NEG_INF);

  // 1: scaled scores, -inf where a row must not see the key (causal, window); each row's max
  __m256 top[QB];
  for (int r = 0; r < QB; ++r) top[r] = neg_inf;
  for (int64_t k = 0; k < span; k += KB) {
    __m256 s[QB];
    for (int r = 0; r < QB; ++r) s[r] = _mm256_setzero_ps();
    const float* tile = head.k.data() + (first_key + k) * D;
    for (int p = 0; p < D; ++p) {
      const __m256 keys = _mm256_loadu_ps(tile + p * KB);
      for (int r = 0; r < QB; ++r) s[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&qs[r][p]), keys, s[r]);
    }
    const __m256i key = _mm256_add_epi32(_mm256_set1_epi32(int(first_key + k)), lane);
    for (int r = 0; r < QB; ++r) {
      const int64_t pos = std::min(pos0 + r, last);  // rows past `count` copy the last one (unused)
      __m256i unseen = _mm256_cmpgt_epi32(key, _mm256_set1_epi32(int(pos)));
      if (window > 0)
        unseen = _mm256_or_si256(unseen, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(pos - window + 1)), key));
      const __m256 row = _mm256_blendv_ps(_mm256_mul_ps(s[r], scale_v), neg_inf, _mm256_castsi256_ps(unseen));
      _mm256_storeu_ps(scores + r * span + k, row);
      top[r] = _mm256_max_ps(top[r], row);
    }
  }
  // 2: p = exp(score - row max), exactly 0 where unseen; the row sums in float32
  float l[QB];
  for (int r = 0; r < QB; ++r) {
    const __m256 m = _mm256_set1_ps(hmax256(top[r]));  // finite: a row sees its own key
    __m256 sum = _mm256_setzero_ps();
    for (int64_t k = 0; k < span; k += KB) {
      const __m256 x = _mm256_loadu_ps(scores + r * span + k);
      const __m256 seen = _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_UQ);
      const __m256 p = _mm256_and_ps(seen, exp256(_mm256_sub_ps(x, m)));
      sum = _mm256_add_ps(sum, p);
      _mm256_storeu_ps(scores + r * span + k, p);
    }
    l[r] = hsum256(sum);
  }
  // 3: out = P V / l over the keys up to the last query's
  for (int r0 = 0; r0 < count; r0 += RG) {
    for (int c0 = 0; c0 < D / 8; c0 += DG) {
      __m256 acc[RG][DG];
      weigh_rows<D>(head, first_key, last, scores, span, r0, c0, acc);
      for (int r = r0; r < std::min<int64_t>(r0 + RG, count); ++r) {
        const __m256 inv = _mm256_set1_ps(1.0f / l[r]);
        for (int c = 0; c < DG; ++c)
          _mm256_storeu_ps(out + r * out_stride + 8 * (c0 + c), _mm256_mul_ps(acc[r - r0][c], inv));
      }
    }
  }
}

template <int D>
void run(const float* q, const float* kv, float* out, int64_t n, int64_t heads, int64_t kv_heads, int64_t plane,
         int64_t position, int64_t window, float scale) {
  const int64_t end = position + n, group = heads / kv_heads;
  std::vector<PackedHead> packed(kv_heads);
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t g = begin; g < stop; ++g) pack_head(kv, end, kv_heads, g, plane, D, packed[g]);
  });
  const int64_t q_blocks = (n + QB - 1) / QB;
  at::parallel_for(0, heads * q_blocks, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < stop; ++item) {
      const int64_t h = item / q_blocks, i = (item % q_blocks) * QB;
      attend_queries<D>(q + (i * heads + h) * D, heads * D, std::min<int64_t>(QB, n - i), position + i, window,
                        scale, packed[h / group], scratch, out + (i * heads + h) * D, heads * D);
    }
  });
}

at::Tensor prefill_attention_f32(at::Tensor q, at::Tensor kv, int64_t position, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 4 && q.is_contiguous() && kv.is_contiguous(), "bad q/kv");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat, "q and kv must be float32");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = kv.size(2);
  TORCH_CHECK(kv.size(3) == d && heads % kv_heads == 0 && position + n <= kv.size(1), "q and kv do not match");
  TORCH_CHECK(d == 64 || d == 128, "head_dim must be 64 or 128");
  auto out = at::empty({n, heads * d}, q.options());
  auto go = d == 64 ? &run<64> : &run<128>;
  go(q.data_ptr<float>(), kv.data_ptr<float>(), out.data_ptr<float>(), n, heads, kv_heads, kv.stride(0), position,
     window, float(scale));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("prefill_attention_f32(Tensor q, Tensor kv, int position, int window, float scale) -> Tensor");
  m.impl("prefill_attention_f32", c10::DispatchKey::CPU, &prefill_attention_f32);
}
#endif
