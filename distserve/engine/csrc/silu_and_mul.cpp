// silu(gate) * up for a gated MLP, fused: x [N, 2I] (gate | up, bfloat16) -> [N, I] bfloat16.
//
// torch runs it as two passes (silu, then mul), ~0.4 ms for a 256-token prompt of the default model,
// 3% of its prefill; one pass in float32 registers costs a fraction of that. bfloat16 only (float32
// keeps torch's ops, so float32 output stays token-exact with transformers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "avx512_math.h"

namespace {

inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}

void silu_mul_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t width) {
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) {
    const __m512 g = load_bf16(gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    const __m512 y = _mm512_mul_ps(silu, load_bf16(up + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(y));
  }
  for (; i < width; ++i) {  // the tail, through c10's conversions
    const float g = float(c10::BFloat16(gate[i], c10::BFloat16::from_bits()));
    const float u = float(c10::BFloat16(up[i], c10::BFloat16::from_bits()));
    out[i] = c10::BFloat16(g / (1.0f + std::exp(-g)) * u).x;
  }
}

}  // namespace

at::Tensor silu_and_mul_bf16(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.scalar_type() == at::kBFloat16, "x: [N, 2I] bfloat16");
  auto xc = x.contiguous();
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  auto out = at::empty({rows, width}, x.options());
  const auto* in = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(in + r * 2 * width, in + r * 2 * width + width, dst + r * width, width);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("silu_and_mul_bf16(Tensor x) -> Tensor");
  m.impl("silu_and_mul_bf16", c10::DispatchKey::CPU, &silu_and_mul_bf16);
}
#endif
