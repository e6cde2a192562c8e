// One decoder layer of a decode-only step at small batch, composed in C++ from the other files' ops.
//
// At batch 1-16 a layer is ~15 small calls around 4 weight-streaming matmuls; issued from Python each
// costs a few microseconds of interpreter and dispatch, ~0.4 ms a step on the default model (10% of
// a bf16 batch-1 step). Here the same calls, in the same order with the same arguments, go through
// the dispatcher from C++. The maths is model.py's op for op, through the same fused kernels of the
// step's dtype (add + RMSNorm, RoPE in place, silu*up: norm_rope.cpp and silu_and_mul.cpp for bfloat16,
// small_ops_f32.cpp for float32); the caller (LlamaModel.forward) only takes this path where the model
// has them and every matmul of the step would run our small-batch kernel and attention our tiled
// kernel for this dtype.
//
// h, normed:     [B, hidden] the residual stream and its input norm (from the layer before)
// cos, sin:      [B, D] this step's RoPE rows
// layer_cache:   [2, num_blocks + 1, block_size, Hkv, D] this layer's cache; slots [B] where the new
//                tokens' K/V go; block_tables [B, max_blocks], seq_lens [B] as the attention kernels take
// returns        (h + attention + MLP, its norm with next_norm): the next layer's inputs
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

namespace {

// Signature: the registered function's own, argument for argument (the dispatcher checks it).
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  static auto skinny = find_op<at::Tensor(at::Tensor, at::Tensor)>("distserve::skinny_linear");
  auto y = skinny.call(x, w);
  return bias.has_value() ? y + *bias : y;  // as linear.Linear
}

// (residual + delta, its RMSNorm): model.LlamaModel._add_norm through SmallOps.add_rms_norm.
std::tuple<at::Tensor, at::Tensor> add_norm(const at::Tensor& residual, const at::Tensor& delta,
                                            const at::Tensor& weight, double eps) {
  using AddNorm = std::tuple<at::Tensor, at::Tensor>(at::Tensor, c10::optional<at::Tensor>, at::Tensor, double);
  if (residual.scalar_type() == at::kBFloat16) {  // each looked up on first use: bf16's needs AVX512-BF16
    static auto fused = find_op<AddNorm>("distserve::add_rms_norm_bf16");
    return fused.call(residual, delta, weight, eps);
  }
  static auto fused = find_op<AddNorm>("distserve::add_rms_norm_f32");
  return fused.call(residual, delta, weight, eps);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor h, at::Tensor normed, at::Tensor qkv_w, c10::optional<at::Tensor> qkv_b, at::Tensor o_w,
    at::Tensor gate_up_w, at::Tensor down_w, at::Tensor post_norm_w, at::Tensor next_norm_w, at::Tensor cos,
    at::Tensor sin, at::Tensor layer_cache, at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
    int64_t heads, int64_t kv_heads, int64_t window, double scale, double eps) {
  const bool bf16 = h.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || h.scalar_type() == at::kFloat, "decode_layer: bfloat16 or float32");
  const int64_t batch = h.size(0), head_dim = layer_cache.size(-1);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  static const c10::optional<at::Tensor> no_bias;

  // Attention: model.LlamaModel._qkv, PagedKvCache.write_slots, PagedDecodeAttention.
  auto qkv = small_batch_linear(normed, qkv_w, qkv_b);  // [B, (H + 2 Hkv) D]
  using Rope = void(at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t);
  if (bf16) {
    static auto rope = find_op<Rope>("distserve::rope_bf16_");
    rope.call(qkv, cos, sin, heads + kv_heads, head_dim);  // q and k rotated in place
  } else {
    static auto rope = find_op<Rope>("distserve::rope_f32_");
    rope.call(qkv, cos, sin, heads + kv_heads, head_dim);
  }
  auto q = qkv.narrow(1, 0, q_width).view({batch, heads, head_dim});
  auto k = qkv.narrow(1, q_width, kv_width).view({batch, kv_heads, head_dim});
  auto v = qkv.narrow(1, q_width + kv_width, kv_width).view({batch, kv_heads, head_dim});
  auto flat = layer_cache.view({2, -1, kv_heads, head_dim});  // [2, total_slots, Hkv, D]
  flat[0].index_copy_(0, slots, k);
  flat[1].index_copy_(0, slots, v);
  at::Tensor attended;  // [B, H, D]
  using Attention = at::Tensor(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double);
  if (bf16) {  // each looked up on first use: a CPU without AVX512-BF16 has only the float32 one
    static auto attend = find_op<Attention>("distserve::paged_decode_attention_bf16");
    attended = attend.call(q.contiguous(), layer_cache, block_tables, seq_lens, window, scale);
  } else {
    static auto attend = find_op<Attention>("distserve::paged_decode_attention_f32");
    attended = attend.call(q.contiguous(), layer_cache, block_tables, seq_lens, window, scale);
  }
  auto [h1, normed1] = add_norm(h, small_batch_linear(attended.view({batch, -1}), o_w, no_bias), post_norm_w, eps);

  // MLP: model.LlamaModel._mlp.
  auto gate_up = small_batch_linear(normed1, gate_up_w, no_bias);  // [B, 2I]
  at::Tensor activated;
  if (bf16) {
    static auto silu_mul = find_op<at::Tensor(at::Tensor)>("distserve::silu_and_mul_bf16");
    activated = silu_mul.call(gate_up);
  } else {
    static auto silu_mul = find_op<at::Tensor(at::Tensor)>("distserve::silu_and_mul_f32");
    activated = silu_mul.call(gate_up);
  }
  return add_norm(h1, small_batch_linear(activated, down_w, no_bias), next_norm_w, eps);
}

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("decode_layer(Tensor h, Tensor normed, Tensor qkv_w, Tensor? qkv_b, Tensor o_w, Tensor gate_up_w, "
        "Tensor down_w, Tensor post_norm_w, Tensor next_norm_w, Tensor cos, Tensor sin, Tensor(a!) layer_cache, "
        "Tensor slots, Tensor block_tables, Tensor seq_lens, int heads, int kv_heads, int window, float scale, "
        "float eps) -> (Tensor, Tensor)");
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
}
