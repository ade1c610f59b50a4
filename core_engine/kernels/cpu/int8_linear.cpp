// int8 x int8 products with 16-bit activation precision, for the core engine's CPU path.
//
// y = x @ W^T with W stored as int8 rows and one fp32 scale per row (W ~= w_scale[n] * Wq[n]).
// Each activation row is scaled to u = x / s (s = max|x| / 127) and split into two int8
// digits, u ~= q1 + q2 / 254 (q1 = round(u), q2 = round(254 (u - q1)), both in [-127, 127]):
// a 16-bit fixed-point activation. The two digit planes are stacked as 2M rows and
// multiplied by Wq in one int8 GEMM (at::_int_mm: oneDNN's VNNI kernels), then recombined:
//     y[m, n] = s[m] * w_scale[n] * (acc[m, n] + acc[M + m, n] / 254)  (+ bias, + residual)
// With ``weight_lo`` the weight gets a second int8 digit too (W ~= w_scale (Wq + Wlo / 254)):
// one more GEMM of the high activation plane by Wlo (the low x low product is below both
// roundings and skipped), ~1.5x the cost for a near-fp32 product (used for the LM head).
// One call per projection, so the Python-level cost is one function call.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr float kDigit = 127.0f;
constexpr float kLow = 254.0f;  // |u - q1| <= 0.5, so 254 (u - q1) fits in [-127, 127]

// x: (M, K) fp32 contiguous -> planes: (2M, K) int8, scales: (M) fp32
void quantize_rows(const at::Tensor& x, at::Tensor& planes, at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  int8_t* hi = planes.data_ptr<int8_t>();
  int8_t* lo = hi + M * K;
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xp + m * K;
      float amax = 0.0f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
      const float s = amax > 0.0f ? amax / kDigit : 1.0f;
      const float inv = 1.0f / s;
      sp[m] = s;
      int8_t* h = hi + m * K;
      int8_t* l = lo + m * K;
      for (int64_t k = 0; k < K; ++k) {
        const float u = std::min(kDigit, std::max(-kDigit, row[k] * inv));
        const float q1 = std::nearbyint(u);
        h[k] = static_cast<int8_t>(q1);
        l[k] = static_cast<int8_t>(std::nearbyint(kLow * (u - q1)));
      }
    }
  });
}

}  // namespace

// x: (M, K) fp32; weight: (N, K) int8; w_scale: (N) fp32; bias: (N) fp32 or undefined;
// residual: (M, N) fp32 or undefined. Returns (M, N) fp32.
at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& w_scale,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                       const c10::optional<at::Tensor>& weight_lo) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "int8_linear: x must be 2-D fp32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "int8_linear: weight must be 2-D int8");
  TORCH_CHECK(x_in.size(1) == weight.size(1), "int8_linear: x and weight disagree on K");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  at::Tensor planes = at::empty({2 * M, K}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({M}, x.options());
  quantize_rows(x, planes, scales);
  const at::Tensor acc = at::_int_mm(planes, weight.t());  // (2M, N) int32
  at::Tensor acc_lo;
  const int32_t* lp = nullptr;
  if (weight_lo.has_value() && weight_lo->defined()) {
    TORCH_CHECK(weight_lo->sizes() == weight.sizes() && weight_lo->scalar_type() == at::kChar,
                "int8_linear: weight_lo must be int8 shaped like weight");
    acc_lo = at::_int_mm(planes.narrow(0, 0, M), weight_lo->t());  // (M, N): high plane x Wlo
    lp = acc_lo.data_ptr<int32_t>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* sp = scales.data_ptr<float>();
  const float* wp = w_scale.data_ptr<float>();
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  at::Tensor res;
  const float* rp = nullptr;
  if (residual.has_value() && residual->defined()) {
    res = residual->contiguous();
    TORCH_CHECK(res.size(0) == M && res.size(1) == N, "int8_linear: residual must be (M, N)");
    rp = res.data_ptr<float>();
  }
  float* op = out.data_ptr<float>();
  // Rows split over torch's intra-op threads (grain: ~64K outputs per task).
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(N, 1));
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int32_t* a1 = ap + m * N;
      const int32_t* a2 = ap + (M + m) * N;
      const float s = sp[m];
      float* o = op + m * N;
      for (int64_t n = 0; n < N; ++n) {
        float low = static_cast<float>(a2[n]);
        if (lp) low += static_cast<float>(lp[m * N + n]);
        float v = s * wp[n] * (static_cast<float>(a1[n]) + low * (1.0f / kLow));
        if (bp) v += bp[n];
        if (rp) v += rp[m * N + n];
        o[n] = v;
      }
    }
  });
  return out;
}

// A plain Python function (pybind11), not a dispatcher op: ~1 us per call from Python, which
// matters at 121 projections per decode step.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "y = x @ (w_scale * weight)^T (+ bias) (+ residual)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("w_scale"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("residual") = pybind11::none(),
        pybind11::arg("weight_lo") = pybind11::none());
}
