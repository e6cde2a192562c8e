// y = x @ w.T for a single row (or very few): a weight-streaming GEMV for batch-1 decode.
//
// x: [M, K] (float32 or bfloat16), w: [N, K] of x's dtype, row-major as stored in the checkpoint.
// returns [M, N] in x's dtype; products and sums in float32.
//
// Library GEMMs tile for large M and read these weights well below the memory bandwidth at M = 1;
// batch-1 decode is bound by exactly that read. Each weight row is widened to float32 once
// (L1-resident) and dotted with every row of x. Each dot is one dependent FMA chain, so beyond a
// couple of rows it is compute-bound and slower than oneDNN (register-blocked variants measured no
// better): callers use it for one row only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "widen.h"

#include <algorithm>
#include <cstdint>
#include <vector>

template <typename scalar_t>
static void skinny_rows(const float* x, const scalar_t* w, scalar_t* y, int64_t m, int64_t n, int64_t k,
                        int64_t begin, int64_t end) {
  std::vector<float> row(k);  // one weight row widened to float32 (L1-resident)
  for (int64_t j = begin; j < end; ++j) {
    const float* wj = row.data();
    if constexpr (std::is_same_v<scalar_t, float>) {
      wj = reinterpret_cast<const float*>(w + j * k);
    } else {
      widen<scalar_t>(w + j * k, row.data(), k);
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = x + i * k;
      float dot = 0.0f;
      for (int64_t t = 0; t < k; ++t) dot += xi[t] * wj[t];
      y[i * n + j] = scalar_t(dot);
    }
  }
}

at::Tensor skinny_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "skinny_linear: x and w dtypes differ");
  auto wc = w.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto xf = x.to(at::kFloat).contiguous();  // [M, K], small: stays in cache for every weight row
  auto y = at::empty({m, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "skinny_linear", [&] {
    const float* x_ptr = xf.data_ptr<float>();
    const scalar_t* w_ptr = wc.data_ptr<scalar_t>();
    scalar_t* y_ptr = y.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      skinny_rows<scalar_t>(x_ptr, w_ptr, y_ptr, m, n, k, begin, end);
    });
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(distserve, m) {
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
  m.impl("skinny_linear", c10::DispatchKey::CPU, &skinny_linear);
}
