// Fused small ops of a float32 decoder layer, the float32 twins of norm_rope.cpp and silu_and_mul.cpp
// (the same contracts, with `_f32` names), each one pass over its rows instead of torch's 3-8:
//
// add_rms_norm_f32(residual [N, C], delta [N, C] or None, weight [C], eps) -> (sum, normed)
//   sum = residual + delta, normed = weight * (sum * 1 / sqrt(mean(sum^2) + eps)) (LlamaRMSNorm);
// rope_f32_(qkv [N, (H + 2 Hkv) D], cos [N, D], sin [N, D], rotated_heads, head_dim)
//   rotates the first rotated_heads heads of every row in place (rotate-half RoPE, as apply_rope);
// silu_and_mul_f32(x [N, 2I]) -> [N, I] = silu(gate) * up.
//
// Plain loops, vectorised by the -O3 -march=native -ffast-math build for whatever the CPU has (AVX-512,
// AVX2, SSE), so they are built everywhere. They round differently from torch's ops in the last bits
// (sums in another order, fused multiply-adds, our exp), as our attention kernels do; greedy output
// stays equal to transformers' generate in the token-exact tests. Why: a 256-token float32 prefill of
// the default model spent ~15 ms of ~175 in torch's small ops on one core of an AMD EPYC (Zen 3).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

// exp(x) as 2^n * p(r) (avx512_math.h's polynomial), x clamped to [-87, 88], in scalar code the
// compiler vectorises: no call into libm, whose vector variants (libmvec) the extension does not link.
inline float exp_poly(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

void add_norm_row(const float* residual, const float* delta, const float* weight, float* sum, float* normed,
                  int64_t width, float eps) {
  float squares = 0.0f;
  const float* source = residual;
  if (delta != nullptr) {
    for (int64_t i = 0; i < width; ++i) {
      const float x = residual[i] + delta[i];
      sum[i] = x;
      squares += x * x;
    }
    source = sum;
  } else {
    for (int64_t i = 0; i < width; ++i) squares += residual[i] * residual[i];
  }
  const float scale = 1.0f / std::sqrt(squares / float(width) + eps);
  for (int64_t i = 0; i < width; ++i) normed[i] = weight[i] * (source[i] * scale);
}

void rope_row(float* row, const float* cos, const float* sin, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x = row + h * d;
    for (int64_t i = 0; i < half; ++i) {  // rotate_half: (x1, x2) -> (-x2, x1)
      const float first = x[i], second = x[half + i];
      x[i] = first * cos[i] - second * sin[i];
      x[half + i] = second * cos[half + i] + first * sin[half + i];
    }
  }
}

void silu_mul_row(const float* gate, const float* up, float* out, int64_t width) {
  for (int64_t i = 0; i < width; ++i) out[i] = gate[i] / (1.0f + exp_poly(-gate[i])) * up[i];
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_rms_norm_f32(at::Tensor residual, c10::optional<at::Tensor> delta,
                                                    at::Tensor weight, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.scalar_type() == at::kFloat && residual.is_contiguous(),
              "residual: [N, C] float32, contiguous");
  const int64_t rows = residual.size(0), width = residual.size(1);
  TORCH_CHECK(weight.numel() == width && weight.scalar_type() == at::kFloat, "weight: [C] float32");
  at::Tensor d, sum = residual;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == residual.sizes() && d.scalar_type() == at::kFloat, "delta: like residual");
    sum = at::empty_like(residual);
  }
  auto w = weight.contiguous();
  auto normed = at::empty_like(residual);
  const float* r_ptr = residual.data_ptr<float>();
  const float* d_ptr = delta.has_value() ? d.data_ptr<float>() : nullptr;
  const float* w_ptr = w.data_ptr<float>();
  float* s_ptr = sum.data_ptr<float>();
  float* n_ptr = normed.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      add_norm_row(r_ptr + r * width, d_ptr ? d_ptr + r * width : nullptr, w_ptr, s_ptr + r * width,
                   n_ptr + r * width, width, float(eps));
  });
  return {sum, normed};
}

void rope_f32_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t rotated_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "qkv: [N, W] float32");
  TORCH_CHECK(head_dim % 2 == 0 && rotated_heads * head_dim <= qkv.size(1), "head_dim must be even");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0) && cos.size(1) == head_dim &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos, sin: [N, D] float32");
  auto c = cos.contiguous(), s = sin.contiguous();
  const int64_t rows = qkv.size(0), width = qkv.size(1);
  float* x = qkv.data_ptr<float>();
  const float* c_ptr = c.data_ptr<float>();
  const float* s_ptr = s.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rope_row(x + r * width, c_ptr + r * head_dim, s_ptr + r * head_dim, rotated_heads, head_dim);
  });
}

at::Tensor silu_and_mul_f32(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.scalar_type() == at::kFloat, "x: [N, 2I] float32");
  auto xc = x.contiguous();
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  auto out = at::empty({rows, width}, x.options());
  const float* in = xc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(in + r * 2 * width, in + r * 2 * width + width, dst + r * width, width);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("add_rms_norm_f32(Tensor residual, Tensor? delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm_f32", c10::DispatchKey::CPU, &add_rms_norm_f32);
  m.def("rope_f32_(Tensor(a!) qkv, Tensor cos, Tensor sin, int rotated_heads, int head_dim) -> ()");
  m.impl("rope_f32_", c10::DispatchKey::CPU, &rope_f32_);
  m.def("silu_and_mul_f32(Tensor x) -> Tensor");
  m.impl("silu_and_mul_f32", c10::DispatchKey::CPU, &silu_and_mul_f32);
}
