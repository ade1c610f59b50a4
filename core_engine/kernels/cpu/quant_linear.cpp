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
// Below ``dense_rows`` rows the products are register blocks of activation x weight rows
// (few_rows_times: 1 x 4 and 2 x 4 for decode, 4 x 2 beyond); the portable build unpacks two
// weight rows into L1 and sweeps every activation row over them.
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
// Rows ahead (in units of the rows one call of few_rows_times takes) whose codes are prefetched.
constexpr int64_t kPrefetchRows = 4;

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
inline float hsum128(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}
#endif

#ifndef IMX_AVX2
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
        for (int t = 0; t < 16; ++t) {
          codes[b * kBlock + t] = p[b * 16 + t] & 0x0F;
          codes[b * kBlock + t + 16] = p[b * 16 + t] >> 4;
        }
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
  }
}
#endif  // !IMX_AVX2

// Added to each output as it is written: a bias (N) and a residual (M, N), fp32 (or null).
struct Epilogue {
  const float* bias = nullptr;
  const float* residual = nullptr;
};

#ifdef IMX_AVX2

inline float hsum256(__m256 v) {
  return hsum128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

// MR activation rows times NR weight rows from n (a register block: MR x NR <= 8 accumulators),
// the weight codes unpacked in registers (no buffer, the weights are streamed once). Each block's
// 8 int32 partial dots are scaled by d_w * d_x into 8 float lanes, summed once per output rather
// than once per block; every MR x NR block computes an output in the same order, so a row's
// result does not depend on how many rows the call has. The codes and scales of the rows this
// thread takes next are prefetched, which keeps enough loads in flight to stream from DRAM
// (measured on a Xeon, 2 threads, 336 MB of int4 weights at one row: 7.8 GB/s before, 19.9 GB/s
// with NR = 4 and the prefetch; docs/benchmarks.md).
template <bool kInt4, int MR, int NR>
void few_rows_times(const QuantizedRows& a, int64_t K, int64_t N, const uint8_t* qw, const uint16_t* d,
                    const uint16_t* mins, int64_t m0, int64_t n, const Epilogue& e, float* y) {
  const int64_t nb = K / kBlock, nbp = a.nbp, kp = nbp * kBlock;
  const int64_t row_bytes = kInt4 ? K / 2 : K;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int8_t* x[MR];
  const float* dx[MR];
  for (int i = 0; i < MR; ++i) {
    x[i] = a.codes.data() + (m0 + i) * kp;
    dx[i] = a.scale.data() + (m0 + i) * nbp;
  }
  for (int j = 0; j < NR; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(d + (n + j + kPrefetchRows * NR) * nb), _MM_HINT_T0);
    if (kInt4) _mm_prefetch(reinterpret_cast<const char*>(mins + (n + j + kPrefetchRows * NR) * nb), _MM_HINT_T0);
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[NR], sg[NR];
    float dw[NR];
    for (int j = 0; j < NR; ++j) {
      const uint8_t* row = qw + (n + j) * row_bytes;
      // The rows this thread takes after these: one prefetch per cache line of codes.
      if (((b * (kInt4 ? 16 : kBlock)) & 63) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(row + b * (kInt4 ? 16 : kBlock) + kPrefetchRows * NR * row_bytes), _MM_HINT_T0);
      if (kInt4) {
        w[j] = load_int4_block(row + b * 16);
      } else {
        sg[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
        w[j] = _mm256_sign_epi8(sg[j], sg[j]);
      }
      dw[j] = half_to_float(d[(n + j) * nb + b]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i] + b * kBlock));
      const float dxb = dx[i][b];
      for (int j = 0; j < NR; ++j) {
        const __m256i p = dot_u8s8(w[j], kInt4 ? xv : _mm256_sign_epi8(xv, sg[j]));
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[j] * dxb), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float v = hsum256(acc[i][j]);
      if (kInt4) {  // + sum_b m_w[b] * dx[b] * sum(q_x)[b], 8 blocks at a time
        const float* sx = a.scaled_sum.data() + (m0 + i) * nbp;
        const uint16_t* mw = mins + (n + j) * nb;
        __m256 s = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8)
          s = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mw + b))),
                              _mm256_loadu_ps(sx + b), s);
        v += hsum256(s);
        for (; b < nb; ++b) v += half_to_float(mw[b]) * sx[b];
      }
      if (e.bias) v += e.bias[n + j];
      if (e.residual) v += e.residual[(m0 + i) * N + n + j];
      y[(m0 + i) * N + n + j] = v;
    }
}
#endif

template <bool kInt4>
bool quantized_product(const QuantizedRows& a, int64_t M, int64_t K, int64_t N, const uint8_t* qw,
                       const uint16_t* d, const uint16_t* mins, const Epilogue& e, float* y) {
#ifdef IMX_AVX2
  if (M <= 2) {  // decode: output columns split over the threads 4 weight rows at a time
    at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t p_begin, int64_t p_end) {
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t n = 4 * p;
        if (n + 4 > N) {
          for (int64_t r = n; r < N; ++r)
            for (int64_t m = 0; m < M; ++m) few_rows_times<kInt4, 1, 1>(a, K, N, qw, d, mins, m, r, e, y);
        } else if (M == 1) {
          few_rows_times<kInt4, 1, 4>(a, K, N, qw, d, mins, 0, n, e, y);
        } else {
          few_rows_times<kInt4, 2, 4>(a, K, N, qw, d, mins, 0, n, e, y);
        }
      }
    });
    return true;
  }
  // Output columns split over the threads in pairs of weight rows; each pair is multiplied with
  // the activation rows 4 at a time (a 4 x 2 register block), so its codes are read from memory
  // once per call and unpacked from L1 for the next rows.
  at::parallel_for(0, (N + 1) / 2, 8, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t n = 2 * p;
      if (n + 1 >= N) {
        for (int64_t m = 0; m < M; ++m) few_rows_times<kInt4, 1, 1>(a, K, N, qw, d, mins, m, n, e, y);
        continue;
      }
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) few_rows_times<kInt4, 4, 2>(a, K, N, qw, d, mins, m0, n, e, y);
      switch (M - m0) {
        case 1: few_rows_times<kInt4, 1, 2>(a, K, N, qw, d, mins, m0, n, e, y); break;
        case 2: few_rows_times<kInt4, 2, 2>(a, K, N, qw, d, mins, m0, n, e, y); break;
        case 3: few_rows_times<kInt4, 3, 2>(a, K, N, qw, d, mins, m0, n, e, y); break;
        default: break;
      }
    }
  });
  return true;  // the epilogue is applied
#else
  // Portable loops. Output columns split over the threads; each thread unpacks two weight rows
  // at a time into L1 and sweeps every activation row over them, so its slice of the weights is
  // read from memory once per call.
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
  return false;  // the caller adds bias and residual
#endif
}

#ifdef IMX_AVX2
// 8 floats -> 8 bf16, rounded to nearest even (torch's conversion; the weights hold no NaN).
inline __m128i to_bf16(__m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  return reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(v));  // one instruction, the same rounding
#else
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
#endif
}

inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }
inline void store8(at::BFloat16* o, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(o), to_bf16(v)); }
#endif

// Rows n0..n1 of the weight, dequantised: (n1 - n0, K) fp32 or bf16 (Out). The arithmetic is
// d * q (+ m), a multiply then an add in fp32 in both the vector and the portable loops.
template <bool kInt4, typename Out>
void dequantize_rows(int64_t K, const uint8_t* qw, const uint16_t* d, const uint16_t* mins, int64_t n0,
                     int64_t n1, Out* out) {
  const int64_t nb = K / kBlock;
  const int64_t row_bytes = kInt4 ? K / 2 : K;
  at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      Out* o = out + (n - n0) * K;
      const uint8_t* p = qw + n * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        const float dw = half_to_float(d[n * nb + b]);
#ifdef IMX_AVX2
        const __m256 dv = _mm256_set1_ps(dw);
        if (kInt4) {
          const __m256 mv = _mm256_set1_ps(half_to_float(mins[n * nb + b]));
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * 16));
          const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
          const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
          const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
          for (int c = 0; c < 4; ++c) {
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[c]));
            store8(o + b * kBlock + 8 * c, _mm256_add_ps(_mm256_mul_ps(dv, q), mv));
          }
        } else {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b * kBlock));
          const __m128i halves[2] = {_mm256_castsi256_si128(raw), _mm256_extracti128_si256(raw, 1)};
          for (int c = 0; c < 4; ++c) {
            const __m128i part = c % 2 == 0 ? halves[c / 2] : _mm_srli_si128(halves[c / 2], 8);
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part));
            store8(o + b * kBlock + 8 * c, _mm256_mul_ps(dv, q));
          }
        }
#else
        if (kInt4) {
          const float mw = half_to_float(mins[n * nb + b]);
          const uint8_t* q = p + b * 16;
          for (int t = 0; t < 16; ++t) {
            o[b * kBlock + t] = static_cast<Out>(dw * static_cast<float>(q[t] & 0x0F) + mw);
            o[b * kBlock + t + 16] = static_cast<Out>(dw * static_cast<float>(q[t] >> 4) + mw);
          }
        } else {
          const int8_t* q = reinterpret_cast<const int8_t*>(p) + b * kBlock;
          for (int t = 0; t < kBlock; ++t) o[b * kBlock + t] = static_cast<Out>(dw * static_cast<float>(q[t]));
        }
#endif
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
  bool added = false;  // bias and residual already in y
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
    const bool bf16 = out_dtype == at::kBFloat16;
    h = h.to(bf16 ? at::kBFloat16 : at::kFloat).contiguous();
    y = at::empty({M, N}, h.options());
    // Tiles of weight rows dequantised straight to the GEMM's dtype (no fp32 copy for bf16).
    constexpr int64_t kTileRows = 512;
    at::Tensor tile = at::empty({std::min<int64_t>(kTileRows, N), K}, h.options());
    for (int64_t n0 = 0; n0 < N; n0 += kTileRows) {
      const int64_t n1 = std::min(N, n0 + kTileRows);
      at::Tensor wt = tile.narrow(0, 0, n1 - n0);
      if (bf16) {
        at::BFloat16* w = wt.data_ptr<at::BFloat16>();
        int4 ? dequantize_rows<true>(K, qw, dp, mp, n0, n1, w) : dequantize_rows<false>(K, qw, dp, mp, n0, n1, w);
      } else {
        float* w = wt.data_ptr<float>();
        int4 ? dequantize_rows<true>(K, qw, dp, mp, n0, n1, w) : dequantize_rows<false>(K, qw, dp, mp, n0, n1, w);
      }
      at::Tensor yt = y.narrow(1, n0, n1 - n0);
      at::mm_out(yt, h, wt.t());
    }
    y = y.to(at::kFloat);
  } else {
    QuantizedRows a;
    prepare_rows(x, K, nwp, eps, swiglu, a);
    y = at::empty({M, N}, x.options());
    Epilogue e;
    at::Tensor bias_f, residual_f;
    if (bias.has_value() && bias->defined()) {
      bias_f = bias->to(at::kFloat).contiguous();
      TORCH_CHECK(bias_f.numel() == N, "quant_linear: bias must have N values");
      e.bias = bias_f.data_ptr<float>();
    }
    if (residual.has_value() && residual->defined()) {
      TORCH_CHECK(residual->size(0) == M && residual->size(1) == N, "quant_linear: residual must be (M, N)");
      residual_f = residual->to(at::kFloat).contiguous();
      e.residual = residual_f.data_ptr<float>();
    }
    added = int4 ? quantized_product<true>(a, M, K, N, qw, dp, mp, e, y.data_ptr<float>())
                 : quantized_product<false>(a, M, K, N, qw, dp, mp, e, y.data_ptr<float>());
  }
  if (!added) {
    if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
    if (residual.has_value() && residual->defined()) {
      TORCH_CHECK(residual->size(0) == M && residual->size(1) == N, "quant_linear: residual must be (M, N)");
      y.add_(residual->to(at::kFloat));
    }
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
