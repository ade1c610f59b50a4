// Block-quantised weight products for the core engine's CPU path: int4 and int8 weights in
// blocks of 32 along K (GGUF's Q4_1 and Q8_0 layouts split into arrays), times activations
// quantised to int8 per block of 32, accumulated in int32 per block and in fp32 across blocks.
//
//   int4: W[n, k] = d[n, b] * q + m[n, b],   q in 0..15, b = k / 32
//         qweight (N, K/2) uint8: byte j of block b holds q of k = 32b + j (low nibble) and
//         of k = 32b + j + 16 (high nibble); d, m (N, K/32) fp16.
//   int8: W[n, k] = d[n, b] * q,             q in -128..127; qweight (N, K) int8; d (N, K/32) fp16.
//
// Each activation row is cut into blocks of 32, each with its own scale dx = max|x| / 127 and
// codes qx = round(x / dx) (as llama.cpp's Q8_1 activations), so
//     y[m, n] = sum_b d[n, b] dx[m, b] <q_w, q_x>_b  +  sum_b m[n, b] dx[m, b] sum(q_x)_b.
// The <q_w, q_x> dot of 32 codes is one AVX2 maddubs + madd (u8 x s8 -> s16 pairs -> s32),
// or one VNNI dpbusd on CPUs that have it (AVX512-VNNI with VL, or AVX-VNNI), chosen at
// compile time by -march=native (the library is cached per CPU; see __init__.py).
//
// Fused around the product, so a decoder layer makes fewer calls: an RMSNorm of the input
// rows (``norm_weight``), SwiGLU of a (M, 2K) gate|up input (``swiglu``), a bias, a residual
// added in the output pass, and RoPE on the first ``rope_cols`` outputs (the q and k heads of
// a fused QKV projection).
//
// Inputs of ``dense_rows`` rows or more (prefill chunks) dequantise the weights in tiles of rows
// to the activation dtype and multiply them with at::mm (MKL/oneDNN: AMX bf16 on CPUs that
// have it), which beats the int8 dot products once a tile is reused by many rows; the input
// is quantised to the same int8 blocks first, so both paths compute the same products.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define IMX_AVX2 1
#endif

namespace {

constexpr int kBlock = 32;

inline float half_to_float(uint16_t h) {
#ifdef IMX_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

constexpr int kGroup = 4;  // blocks whose dot products are reduced together

inline int64_t padded_blocks(int64_t K) { return (K / kBlock + kGroup - 1) / kGroup * kGroup; }

// Activations of M rows, quantised: codes (M, Kp) int8; per block scale dx and dx * sum(codes).
// Rows are padded with zero blocks to a multiple of kGroup blocks (Kp = padded_blocks * 32).
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<float> scaled_sum;
  int64_t nbp = 0;
};

// src: the K values of one row (already normed / SwiGLU'd) -> codes and block scales.
inline void quantize_row(const float* src, int64_t K, int8_t* codes, float* scale, float* scaled_sum) {
  const int64_t nb = K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const float* v = src + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    int8_t* q = codes + b * kBlock;
    for (int i = 0; i < kBlock; ++i) {
      const int c = static_cast<int>(std::nearbyint(v[i] * inv));
      q[i] = static_cast<int8_t>(c);
      sum += c;
    }
    scale[b] = d;
    scaled_sum[b] = d * static_cast<float>(sum);
  }
}

// The input of the product, row m: x itself, RMSNorm(x) * norm_weight, or silu(gate) * up.
void prepare_rows(const at::Tensor& x, int64_t K, const float* norm_w, double eps, bool swiglu,
                  QuantizedRows& out) {
  const int64_t M = x.size(0);
  const int64_t nbp = padded_blocks(K);
  out.nbp = nbp;
  out.codes.assign(M * nbp * kBlock, 0);
  out.scale.assign(M * nbp, 0.0f);
  out.scaled_sum.assign(M * nbp, 0.0f);
  const float* xp = x.data_ptr<float>();
  const int64_t stride = x.size(1);
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t m = begin; m < end; ++m) {
      const float* src = xp + m * stride;
      if (swiglu) {
        const float* up = src + K;
        for (int64_t k = 0; k < K; ++k) {
          const float g = src[k];
          row[k] = g / (1.0f + std::exp(-g)) * up[k];
        }
      } else if (norm_w) {
        double ss = 0.0;
        for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(src[k]) * src[k];
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / K + eps));
        for (int64_t k = 0; k < K; ++k) row[k] = src[k] * inv * norm_w[k];
      } else {
        std::memcpy(row.data(), src, K * sizeof(float));
      }
      quantize_row(row.data(), K, out.codes.data() + m * nbp * kBlock, out.scale.data() + m * nbp,
                   out.scaled_sum.data() + m * nbp);
    }
  });
}

#ifdef IMX_AVX2
// Sum of the 8 int32 products of 32 u8 x s8 pairs, as 8 int32 lanes.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The 32 codes of one int4 block as unsigned bytes in k order.
inline __m256i load_int4_block(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}
#endif

#ifdef IMX_AVX2
// The dot products of 4 consecutive blocks (8 int32 lanes each) -> their 4 sums.
inline __m128i reduce4(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

inline float hsum128(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

// Block dot product of weight codes w (int4: unsigned; int8: |w| with the signs in ws) and
// activation codes x.
template <bool kInt4>
inline __m256i block_dot(const uint8_t* w, const int8_t* ws, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  if (kInt4) return dot_u8s8(wv, xv);
  const __m256i sv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws));
  return dot_u8s8(wv, _mm256_sign_epi8(xv, sv));
}
#endif

// A weight row unpacked for the dot products: its codes as bytes in k order (int8: |w| and
// w), its block scales (and minima) as floats, zero-padded to whole groups of blocks.
struct UnpackedRow {
  std::vector<uint8_t> codes;
  std::vector<int8_t> signs;
  std::vector<float> scale;
  std::vector<float> min;

  void unpack(bool int4, int64_t K, const uint8_t* qw, const uint16_t* d, const uint16_t* mins, int64_t n) {
    const int64_t nb = K / kBlock, nbp = padded_blocks(K);
    if (static_cast<int64_t>(scale.size()) != nbp) {  // the padding stays zero: only real blocks are written
      codes.assign(nbp * kBlock, 0);
      scale.assign(nbp, 0.0f);
      min.assign(nbp, 0.0f);
      if (!int4) signs.assign(nbp * kBlock, 0);
    }
    for (int64_t b = 0; b < nb; ++b) {
      scale[b] = half_to_float(d[n * nb + b]);
      if (int4) min[b] = half_to_float(mins[n * nb + b]);
    }
    if (int4) {
      const uint8_t* p = qw + n * (K / 2);
      for (int64_t b = 0; b < nb; ++b) {
#ifdef IMX_AVX2
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes.data() + b * kBlock), load_int4_block(p + b * 16));
#else
        for (int t = 0; t < 16; ++t) {
          codes[b * kBlock + t] = p[b * 16 + t] & 0x0F;
          codes[b * kBlock + t + 16] = p[b * 16 + t] >> 4;
        }
#endif
      }
    } else {
      const int8_t* p = reinterpret_cast<const int8_t*>(qw) + n * K;
      for (int64_t k = 0; k < K; ++k) {
        signs[k] = p[k];
        codes[k] = static_cast<uint8_t>(p[k] < 0 ? -static_cast<int>(p[k]) : p[k]);  // |-128| = 128 fits u8
      }
    }
  }
};

// out[m, n] for every row m of the activations and the unpacked weight rows r0 (and r1).
template <bool kInt4>
void rows_times(const QuantizedRows& a, int64_t M, int64_t N, const UnpackedRow& r0, const UnpackedRow* r1,
                int64_t n, float* y) {
  const int64_t nbp = a.nbp, kp = nbp * kBlock;
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* x = a.codes.data() + m * kp;
    const float* dx = a.scale.data() + m * nbp;
    const float* sx = a.scaled_sum.data() + m * nbp;
#ifdef IMX_AVX2
    __m128 acc0 = _mm_setzero_ps(), acc1 = _mm_setzero_ps();
    for (int64_t b = 0; b < nbp; b += kGroup) {
      const int64_t o = b * kBlock;
      const __m128 dxv = _mm_loadu_ps(dx + b);
      const __m128 sxv = _mm_loadu_ps(sx + b);
      {
        const uint8_t* w = r0.codes.data() + o;
        const int8_t* ws = kInt4 ? nullptr : r0.signs.data() + o;
        const __m128i s = reduce4(block_dot<kInt4>(w, ws, x + o), block_dot<kInt4>(w + 32, ws ? ws + 32 : nullptr, x + o + 32),
                                  block_dot<kInt4>(w + 64, ws ? ws + 64 : nullptr, x + o + 64),
                                  block_dot<kInt4>(w + 96, ws ? ws + 96 : nullptr, x + o + 96));
        acc0 = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(_mm_loadu_ps(r0.scale.data() + b), dxv), acc0);
        if (kInt4) acc0 = _mm_fmadd_ps(_mm_loadu_ps(r0.min.data() + b), sxv, acc0);
      }
      if (r1) {
        const uint8_t* w = r1->codes.data() + o;
        const int8_t* ws = kInt4 ? nullptr : r1->signs.data() + o;
        const __m128i s = reduce4(block_dot<kInt4>(w, ws, x + o), block_dot<kInt4>(w + 32, ws ? ws + 32 : nullptr, x + o + 32),
                                  block_dot<kInt4>(w + 64, ws ? ws + 64 : nullptr, x + o + 64),
                                  block_dot<kInt4>(w + 96, ws ? ws + 96 : nullptr, x + o + 96));
        acc1 = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(_mm_loadu_ps(r1->scale.data() + b), dxv), acc1);
        if (kInt4) acc1 = _mm_fmadd_ps(_mm_loadu_ps(r1->min.data() + b), sxv, acc1);
      }
    }
    y[m * N + n] = hsum128(acc0);
    if (r1) y[m * N + n + 1] = hsum128(acc1);
#else
    for (int t = 0; t < (r1 ? 2 : 1); ++t) {
      const UnpackedRow& r = t == 0 ? r0 : *r1;
      float acc = 0.0f;
      for (int64_t b = 0; b < nbp; ++b) {
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i) {
          const int w = kInt4 ? r.codes[b * kBlock + i] : r.signs[b * kBlock + i];
          dot += w * x[b * kBlock + i];
        }
        acc += r.scale[b] * dx[b] * static_cast<float>(dot);
        if (kInt4) acc += r.min[b] * sx[b];
      }
      y[m * N + n + t] = acc;
    }
#endif
  }
}

#ifdef IMX_AVX2
// 4 fp16 values from p (fewer than 4 left in the row: zero-padded) as floats.
inline __m128 load4_half(const uint16_t* p, int64_t left) {
  if (left >= 4) return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t tmp[4] = {0, 0, 0, 0};
  for (int64_t i = 0; i < left; ++i) tmp[i] = p[i];
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tmp)));
}

// Up to 4 activation rows times weight row n, the weight codes unpacked in registers (the
// decode path: no buffer, the row is streamed once).
template <bool kInt4, int MR>
void few_rows_times(const QuantizedRows& a, int64_t K, int64_t N, const uint8_t* qw, const uint16_t* d,
                    const uint16_t* mins, int64_t m0, int64_t n, float* y) {
  const int64_t nb = K / kBlock, nbp = a.nbp, kp = nbp * kBlock;
  __m128 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm_setzero_ps();
  const uint8_t* row = qw + n * (kInt4 ? K / 2 : K);
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t b = 0; b < nbp; b += kGroup) {
    __m256i w[kGroup], sg[kGroup];
    for (int g = 0; g < kGroup; ++g) {
      if (b + g >= nb) {
        w[g] = sg[g] = zero;
      } else if (kInt4) {
        w[g] = load_int4_block(row + (b + g) * 16);
      } else {
        sg[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (b + g) * kBlock));
        w[g] = _mm256_sign_epi8(sg[g], sg[g]);
      }
    }
    const __m128 dw = load4_half(d + n * nb + b, nb - b);
    const __m128 mw = kInt4 ? load4_half(mins + n * nb + b, nb - b) : _mm_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      const int8_t* x = a.codes.data() + (m0 + i) * kp + b * kBlock;
      __m256i p[kGroup];
      for (int g = 0; g < kGroup; ++g) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + g * kBlock));
        if (!kInt4) xv = _mm256_sign_epi8(xv, sg[g]);
        p[g] = dot_u8s8(w[g], xv);
      }
      const float* dx = a.scale.data() + (m0 + i) * nbp + b;
      const __m128i s = reduce4(p[0], p[1], p[2], p[3]);
      acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(dw, _mm_loadu_ps(dx)), acc[i]);
      if (kInt4) acc[i] = _mm_fmadd_ps(mw, _mm_loadu_ps(a.scaled_sum.data() + (m0 + i) * nbp + b), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) y[(m0 + i) * N + n] = hsum128(acc[i]);
}
#endif

// Activation rows up to which weight codes are unpacked in registers rather than in L1.
constexpr int64_t kFewRows = 4;

template <bool kInt4>
void quantized_product(const QuantizedRows& a, int64_t M, int64_t K, int64_t N, const uint8_t* qw,
                       const uint16_t* d, const uint16_t* mins, float* y) {
#ifdef IMX_AVX2
  if (M <= kFewRows) {
    at::parallel_for(0, N, 16, [&](int64_t n_begin, int64_t n_end) {
      for (int64_t n = n_begin; n < n_end; ++n) {
        switch (M) {
          case 1: few_rows_times<kInt4, 1>(a, K, N, qw, d, mins, 0, n, y); break;
          case 2: few_rows_times<kInt4, 2>(a, K, N, qw, d, mins, 0, n, y); break;
          case 3: few_rows_times<kInt4, 3>(a, K, N, qw, d, mins, 0, n, y); break;
          default: few_rows_times<kInt4, 4>(a, K, N, qw, d, mins, 0, n, y); break;
        }
      }
    });
    return;
  }
#endif
  // Output columns split over the threads; each thread unpacks two weight rows at a time into
  // L1 and sweeps every activation row over them, so its slice of the weights is read from
  // memory once per call.
  at::parallel_for(0, N, 16, [&](int64_t n_begin, int64_t n_end) {
    UnpackedRow r0, r1;
    int64_t n = n_begin;
    for (; n + 2 <= n_end; n += 2) {
      r0.unpack(kInt4, K, qw, d, mins, n);
      r1.unpack(kInt4, K, qw, d, mins, n + 1);
      rows_times<kInt4>(a, M, N, r0, &r1, n, y);
    }
    if (n < n_end) {
      r0.unpack(kInt4, K, qw, d, mins, n);
      rows_times<kInt4>(a, M, N, r0, nullptr, n, y);
    }
  });
}

// Rows n0..n1 of the weight, dequantised to fp32: (n1 - n0, K).
template <bool kInt4>
void dequantize_rows(int64_t K, const uint8_t* qw, const uint16_t* d, const uint16_t* mins, int64_t n0,
                     int64_t n1, float* out) {
  const int64_t nb = K / kBlock;
  const int64_t row_bytes = kInt4 ? K / 2 : K;
  at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* o = out + (n - n0) * K;
      const uint8_t* p = qw + n * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        const float dw = half_to_float(d[n * nb + b]);
        if (kInt4) {
          const float mw = half_to_float(mins[n * nb + b]);
          const uint8_t* q = p + b * 16;
          for (int t = 0; t < 16; ++t) {
            o[b * kBlock + t] = dw * static_cast<float>(q[t] & 0x0F) + mw;
            o[b * kBlock + t + 16] = dw * static_cast<float>(q[t] >> 4) + mw;
          }
        } else {
          const int8_t* q = reinterpret_cast<const int8_t*>(p) + b * kBlock;
          for (int t = 0; t < kBlock; ++t) o[b * kBlock + t] = dw * static_cast<float>(q[t]);
        }
      }
    }
  });
}

void check_weight(const at::Tensor& qweight, const at::Tensor& d, const c10::optional<at::Tensor>& mins,
                  bool int4, int64_t K) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "quant_linear: qweight must be 2-D contiguous");
  TORCH_CHECK(K % kBlock == 0, "quant_linear: K must be a multiple of 32, got ", K);
  TORCH_CHECK(qweight.size(1) == (int4 ? K / 2 : K), "quant_linear: qweight has ", qweight.size(1),
              " bytes per row for K = ", K);
  const int64_t N = qweight.size(0);
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.size(0) == N && d.size(1) == K / kBlock,
              "quant_linear: scales must be (N, K/32) fp16");
  if (int4) {
    TORCH_CHECK(mins.has_value() && mins->defined() && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                    mins->sizes() == d.sizes(),
                "quant_linear: int4 needs mins shaped like scales (fp16)");
  }
}

// RoPE (rotate-half) on the first ``cols`` columns of each output row, in heads of ``head_dim``:
// pairs (i, i + head_dim/2) of a head rotate by the row's angle i (cos/sin: (M, head_dim/2)).
void apply_rope(float* y, int64_t M, int64_t N, const float* cos, const float* sin, int64_t cols, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* c = cos + m * half;
      const float* s = sin + m * half;
      for (int64_t h = 0; h < cols; h += head_dim) {
        float* a = y + m * N + h;
        float* b = a + half;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

}  // namespace

// x: (M, K) fp32/bf16, or (M, 2K) with swiglu; returns (M, N) in x's dtype.
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& norm_weight,
                        double eps, bool swiglu, int64_t dense_rows, const c10::optional<at::Tensor>& rope_cos,
                        const c10::optional<at::Tensor>& rope_sin, int64_t rope_cols) {
  TORCH_CHECK(x_in.dim() == 2, "quant_linear: x must be 2-D");
  const bool int4 = qweight.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || qweight.scalar_type() == at::kChar, "quant_linear: qweight must be uint8 (int4) or int8");
  const int64_t M = x_in.size(0);
  const int64_t K = swiglu ? x_in.size(1) / 2 : x_in.size(1);
  TORCH_CHECK(!swiglu || x_in.size(1) == 2 * K, "quant_linear: swiglu input must have 2K columns");
  check_weight(qweight, scales, mins, int4, K);
  TORCH_CHECK(!(swiglu && norm_weight.has_value() && norm_weight->defined()),
              "quant_linear: norm_weight and swiglu are exclusive");
  const int64_t N = qweight.size(0);
  const at::ScalarType out_dtype = x_in.scalar_type();
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor nw;
  const float* nwp = nullptr;
  if (norm_weight.has_value() && norm_weight->defined()) {
    nw = norm_weight->to(at::kFloat).contiguous();
    TORCH_CHECK(nw.numel() == K, "quant_linear: norm_weight must have K values");
    nwp = nw.data_ptr<float>();
  }
  const uint8_t* qw = static_cast<const uint8_t*>(qweight.data_ptr());
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = int4 ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  at::Tensor y;
  if (M == 0) {
    y = at::empty({0, N}, x.options());
  } else if (dense_rows > 0 && M >= dense_rows) {
    // Many rows: dequantised weight tiles times the input in the input's dtype. The input is
    // quantised to int8 blocks and back first, so the arithmetic is the int8 dot products' up
    // to float rounding: a token's logits do not depend on how many rows its step has.
    QuantizedRows a;
    prepare_rows(x, K, nwp, eps, swiglu, a);
    at::Tensor h = at::empty({M, K}, x.options());
    {
      float* hp = h.data_ptr<float>();
      const int64_t nbp = a.nbp, nb = K / kBlock;
      at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m)
          for (int64_t b = 0; b < nb; ++b) {
            const float d = a.scale[m * nbp + b];
            const int8_t* q = a.codes.data() + m * nbp * kBlock + b * kBlock;
            for (int i = 0; i < kBlock; ++i) hp[m * K + b * kBlock + i] = d * static_cast<float>(q[i]);
          }
      });
    }
    h = h.to(out_dtype == at::kBFloat16 ? at::kBFloat16 : at::kFloat).contiguous();
    y = at::empty({M, N}, h.options());
    constexpr int64_t kTileRows = 512;
    at::Tensor tile32 = at::empty({std::min<int64_t>(kTileRows, N), K}, x.options());
    for (int64_t n0 = 0; n0 < N; n0 += kTileRows) {
      const int64_t n1 = std::min(N, n0 + kTileRows);
      at::Tensor wt = tile32.narrow(0, 0, n1 - n0);
      if (int4) {
        dequantize_rows<true>(K, qw, dp, mp, n0, n1, wt.data_ptr<float>());
      } else {
        dequantize_rows<false>(K, qw, dp, mp, n0, n1, wt.data_ptr<float>());
      }
      at::Tensor yt = y.narrow(1, n0, n1 - n0);
      at::mm_out(yt, h, wt.to(h.scalar_type()).t());
    }
    y = y.to(at::kFloat);
  } else {
    QuantizedRows a;
    prepare_rows(x, K, nwp, eps, swiglu, a);
    y = at::empty({M, N}, x.options());
    if (int4) {
      quantized_product<true>(a, M, K, N, qw, dp, mp, y.data_ptr<float>());
    } else {
      quantized_product<false>(a, M, K, N, qw, dp, mp, y.data_ptr<float>());
    }
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->size(0) == M && residual->size(1) == N, "quant_linear: residual must be (M, N)");
    y.add_(residual->to(at::kFloat));
  }
  if (rope_cols > 0 && M > 0) {
    TORCH_CHECK(rope_cos.has_value() && rope_sin.has_value(), "quant_linear: rope_cols needs rope_cos and rope_sin");
    const at::Tensor c = rope_cos->to(at::kFloat).reshape({M, -1}).contiguous();
    const at::Tensor sn = rope_sin->to(at::kFloat).reshape({M, -1}).contiguous();
    const int64_t head_dim = 2 * c.size(1);
    TORCH_CHECK(rope_cols <= N && rope_cols % head_dim == 0, "quant_linear: rope_cols must be whole heads within N");
    apply_rope(y.data_ptr<float>(), M, N, c.data_ptr<float>(), sn.data_ptr<float>(), rope_cols, head_dim);
  }
  return out_dtype == at::kFloat ? y : y.to(out_dtype);
}

// Rows of the weight as fp32 (N, K): the reference of tests and the large-batch tiles.
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins) {
  const bool int4 = qweight.scalar_type() == at::kByte;
  const int64_t K = int4 ? qweight.size(1) * 2 : qweight.size(1);
  check_weight(qweight, scales, mins, int4, K);
  const int64_t N = qweight.size(0);
  at::Tensor out = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* qw = static_cast<const uint8_t*>(qweight.data_ptr());
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = int4 ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  if (int4) {
    dequantize_rows<true>(K, qw, dp, mp, 0, N, out.data_ptr<float>());
  } else {
    dequantize_rows<false>(K, qw, dp, mp, 0, N, out.data_ptr<float>());
  }
  return out;
}

std::string isa() {
#if defined(IMX_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni";
#elif defined(IMX_AVX2) && defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(IMX_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// Plain Python functions (pybind11), not dispatcher ops: ~1 us per call from Python.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = f(x) @ W^T (+ bias) (+ residual), W in int4/int8 blocks of 32",
        pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"), pybind11::arg("mins") = pybind11::none(),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("residual") = pybind11::none(),
        pybind11::arg("norm_weight") = pybind11::none(), pybind11::arg("eps") = 1e-6,
        pybind11::arg("swiglu") = false, pybind11::arg("dense_rows") = 0, pybind11::arg("rope_cos") = pybind11::none(),
        pybind11::arg("rope_sin") = pybind11::none(), pybind11::arg("rope_cols") = 0);
  m.def("quant_dequantize", &quant_dequantize, "the weight as fp32 (N, K)", pybind11::arg("qweight"),
        pybind11::arg("scales"), pybind11::arg("mins") = pybind11::none());
  m.def("isa", &isa, "the instruction set the kernel was compiled for");
}
