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
// The weights are regrouped once at load (quant_pack; the layout is described below): 16
// weight rows side by side, so a vector instruction multiplies 4 codes of each of 16 rows by 4
// activation codes broadcast: VNNI dpbusd on zmm (AVX512-VNNI) or ymm (AVX-VNNI), or AVX2
// maddubs + madd (u8 x s8 -> s16 pairs -> s32), chosen at compile time by -march=native (the
// library is cached per CPU; see __init__.py).
//
// Fused around the product, so a decoder layer makes fewer calls: an RMSNorm of the input
// rows (``norm_weight``), SwiGLU of a (M, 2K) gate|up input (``swiglu``), a bias, a residual
// added in the output pass, and RoPE on the first ``rope_cols`` outputs (the q and k heads of
// a fused QKV projection).
//
// Below ``dense_rows`` rows (0: always) the products are register blocks of up to 8 (zmm) or 4
// (ymm) activation rows times a group of 16 weight rows; the portable build runs the same
// arithmetic in plain loops.
//
// Inputs of ``dense_rows`` rows or more (large prefill chunks) dequantise the weights in tiles
// of rows to the activation dtype and multiply them with at::mm (MKL/oneDNN: AMX bf16 on CPUs
// that have it), where that measures faster; the input is quantised to the same int8 blocks
// first, so both paths compute the same products up to float rounding.
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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define IMX_ZMM 1  // 16 weight rows per zmm register
#endif
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

// Activations of M rows, quantised: codes (M, Kp) int8; per block scale dx, sum(codes) and
// dx * sum(codes). Rows are padded with zero blocks to a multiple of kGroup blocks (Kp =
// padded_blocks * 32).
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> code_sum;
  std::vector<float> scaled_sum;
  int64_t nbp = 0;
};

// src: the K values of one row (already normed / SwiGLU'd) -> codes and block scales.
inline void quantize_row(const float* src, int64_t K, int8_t* codes, float* scale, int32_t* code_sum, float* scaled_sum) {
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
    code_sum[b] = sum;
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
  out.code_sum.assign(M * nbp, 0);
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
                   out.code_sum.data() + m * nbp, out.scaled_sum.data() + m * nbp);
    }
  });
}

// ---- The packed layout ----------------------------------------------------------------------
// quant_pack regroups a weight's blocks for the products: weight rows in groups of kLanes = 16,
// each group a run of records, one per block of 32 along K, in K order:
//   int4 record (320 bytes): codes (4 x 64 bytes) | d of the 16 rows (fp16) | m of the 16 rows (fp16)
//     byte 64 s + 4 j + i = q[j][4 s + i] | q[j][4 s + i + 16] << 4     (s = 0..3, i = 0..3)
//   int8 record (544 bytes): codes (8 x 64 bytes) | d of the 16 rows (fp16)
//     byte 64 t + 4 j + i = q[j][4 t + i]                               (t = 0..7)
// (j: the row within the group; rows past N are zero). One 64-byte vector thus holds 4
// consecutive codes of each of the 16 rows, and one dpbusd with 4 activation codes broadcast
// adds each row's partial dot to its own int32 lane: a block's 16 dots come out whole, in 16
// lanes, with no horizontal sums, and the block scales of the 16 rows are one vector. The
// activation rows are the register block: up to kMaxRows of them share each unpacked vector.
// The 4-byte words of a row's record are its block's bytes in GGUF order (Q4_1 / Q8_0 codes).
//
// Every output is computed in one order, whatever the row count, the ISA or the build:
//     acc = 0;  for each block b:  acc = fma(<q_w, q_x>_b, d_w[b] * d_x[b], acc)
//                                  acc = fma(m_w[b], d_x[b] * sum(q_x)_b, acc)      (int4)
//     y = acc (+ bias) (+ residual)
// with the integer dots exact, so a row's result does not depend on the rows beside it.
constexpr int64_t kLanes = 16;
template <bool kInt4>
constexpr int64_t code_bytes() { return kInt4 ? 256 : 512; }
template <bool kInt4>
constexpr int64_t record_bytes() { return kInt4 ? 320 : 544; }
template <bool kInt4>
constexpr int kWords() { return kInt4 ? 4 : 8; }  // 4-byte words of one row's codes per block
// Bytes ahead of the record being read that are prefetched (the group's run is sequential).
constexpr int64_t kPrefetchBytes = 2048;

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint16_t load_u16(const void* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Added to each output as it is written: a bias (N) and a residual (M, N), fp32 (or null).
struct Epilogue {
  const float* bias = nullptr;
  const float* residual = nullptr;
};

#if defined(IMX_ZMM)
constexpr int kMaxRows = 8;

// MR activation rows (from m0) times the 16 weight rows of one group (from n0), in zmm lanes.
template <bool kInt4, int MR>
void group_times(const QuantizedRows& a, int64_t nb, int64_t N, const uint8_t* group, int64_t n0, int64_t m0,
                 const Epilogue& e, float* y) {
  constexpr int64_t kRec = record_bytes<kInt4>(), kCodes = code_bytes<kInt4>();
  const int64_t nbp = a.nbp, kp = nbp * kBlock;
  __m512 acc[MR];
  const int8_t* x[MR];
  const float* dx[MR];
  const float* sx[MR];
  const int32_t* cs[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm512_setzero_ps();
    x[i] = a.codes.data() + (m0 + i) * kp;
    dx[i] = a.scale.data() + (m0 + i) * nbp;
    sx[i] = a.scaled_sum.data() + (m0 + i) * nbp;
    cs[i] = a.code_sum.data() + (m0 + i) * nbp;
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* r = group + b * kRec;
    for (int64_t line = 0; line < kRec; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(r + kPrefetchBytes + line), _MM_HINT_T0);
    __m512i dot[MR];
    for (int i = 0; i < MR; ++i) dot[i] = _mm512_setzero_si512();
    if constexpr (kInt4) {
      for (int s = 0; s < 4; ++s) {
        const __m512i p = _mm512_loadu_si512(r + 64 * s);
        const __m512i lo = _mm512_and_si512(p, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
        for (int i = 0; i < MR; ++i) {
          dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(load_i32(x[i] + b * kBlock + 4 * s)));
          dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(load_i32(x[i] + b * kBlock + 16 + 4 * s)));
        }
      }
    } else {
      // dpbusd takes unsigned weights: w + 128 (the sign bit flipped), then 128 * sum(q_x) off.
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int t = 0; t < 8; ++t) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(r + 64 * t), flip);
        for (int i = 0; i < MR; ++i)
          dot[i] = _mm512_dpbusd_epi32(dot[i], w, _mm512_set1_epi32(load_i32(x[i] + b * kBlock + 4 * t)));
      }
      for (int i = 0; i < MR; ++i) dot[i] = _mm512_sub_epi32(dot[i], _mm512_set1_epi32(128 * cs[i][b]));
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + kCodes)));
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(dw, _mm512_set1_ps(dx[i][b])), acc[i]);
    if constexpr (kInt4) {
      const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + kCodes + 32)));
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[i][b]), acc[i]);
    }
  }
  const int64_t lanes = std::min(kLanes, N - n0);
  const __mmask16 mask = static_cast<__mmask16>(lanes == 16 ? 0xFFFFu : (1u << lanes) - 1u);
  const __m512 bias = e.bias ? _mm512_maskz_loadu_ps(mask, e.bias + n0) : _mm512_setzero_ps();
  for (int i = 0; i < MR; ++i) {
    __m512 v = acc[i];
    if (e.bias) v = _mm512_add_ps(v, bias);
    if (e.residual) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, e.residual + (m0 + i) * N + n0));
    _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, mask, v);
  }
}

#elif defined(IMX_AVX2)
constexpr int kMaxRows = 4;

// acc + the 8 dots of 4 u8 x s8 pairs per lane.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// As the zmm version, the group's 16 rows as two halves of 8 ymm lanes.
template <bool kInt4, int MR>
void group_times(const QuantizedRows& a, int64_t nb, int64_t N, const uint8_t* group, int64_t n0, int64_t m0,
                 const Epilogue& e, float* y) {
  constexpr int64_t kRec = record_bytes<kInt4>(), kCodes = code_bytes<kInt4>();
  const int64_t nbp = a.nbp, kp = nbp * kBlock;
  __m256 acc[MR][2];
  const int8_t* x[MR];
  const float* dx[MR];
  const float* sx[MR];
  const int32_t* cs[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    x[i] = a.codes.data() + (m0 + i) * kp;
    dx[i] = a.scale.data() + (m0 + i) * nbp;
    sx[i] = a.scaled_sum.data() + (m0 + i) * nbp;
    cs[i] = a.code_sum.data() + (m0 + i) * nbp;
  }
  (void)cs;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* r = group + b * kRec;
    for (int64_t line = 0; line < kRec; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(r + kPrefetchBytes + line), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i dot[MR];
      for (int i = 0; i < MR; ++i) dot[i] = _mm256_setzero_si256();
      if constexpr (kInt4) {
        for (int s = 0; s < 4; ++s) {
          const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 64 * s + 32 * h));
          const __m256i lo = _mm256_and_si256(p, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
          for (int i = 0; i < MR; ++i) {
            dot[i] = dot4(dot[i], lo, _mm256_set1_epi32(load_i32(x[i] + b * kBlock + 4 * s)));
            dot[i] = dot4(dot[i], hi, _mm256_set1_epi32(load_i32(x[i] + b * kBlock + 16 + 4 * s)));
          }
        }
      } else {
        for (int t = 0; t < 8; ++t) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 64 * t + 32 * h));
#if defined(__AVXVNNI__)
          const __m256i u = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
          for (int i = 0; i < MR; ++i)
            dot[i] = dot4(dot[i], u, _mm256_set1_epi32(load_i32(x[i] + b * kBlock + 4 * t)));
#else
          // maddubs: |w| (unsigned) times the activation with w's sign; |w| <= 128 keeps the
          // pair sums within int16.
          const __m256i u = _mm256_sign_epi8(w, w);
          for (int i = 0; i < MR; ++i)
            dot[i] = dot4(dot[i], u, _mm256_sign_epi8(_mm256_set1_epi32(load_i32(x[i] + b * kBlock + 4 * t)), w));
#endif
        }
#if defined(__AVXVNNI__)
        for (int i = 0; i < MR; ++i) dot[i] = _mm256_sub_epi32(dot[i], _mm256_set1_epi32(128 * cs[i][b]));
#endif
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + kCodes + 16 * h)));
      for (int i = 0; i < MR; ++i)
        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(dw, _mm256_set1_ps(dx[i][b])), acc[i][h]);
      if constexpr (kInt4) {
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + kCodes + 32 + 16 * h)));
        for (int i = 0; i < MR; ++i) acc[i][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[i][b]), acc[i][h]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + 8 * h, lanes = std::min<int64_t>(8, N - n);
      if (lanes <= 0) break;
      float* out = y + (m0 + i) * N + n;
      if (lanes == 8) {
        __m256 v = acc[i][h];
        if (e.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(e.bias + n));
        if (e.residual) v = _mm256_add_ps(v, _mm256_loadu_ps(e.residual + (m0 + i) * N + n));
        _mm256_storeu_ps(out, v);
      } else {
        alignas(32) float v[8];
        _mm256_store_ps(v, acc[i][h]);
        for (int64_t j = 0; j < lanes; ++j) {
          float o = v[j];
          if (e.bias) o += e.bias[n + j];
          if (e.residual) o += e.residual[(m0 + i) * N + n + j];
          out[j] = o;
        }
      }
    }
}
#endif

#if defined(IMX_AVX2)
// group_times for rows == R, R - 1, ..., 1.
template <bool kInt4, int R>
inline void tail_rows(int64_t rows, const QuantizedRows& a, int64_t nb, int64_t N, const uint8_t* group, int64_t n0,
                      int64_t m0, const Epilogue& e, float* y) {
  if constexpr (R > 0) {
    if (rows == R) {
      group_times<kInt4, R>(a, nb, N, group, n0, m0, e, y);
    } else {
      tail_rows<kInt4, R - 1>(rows, a, nb, N, group, n0, m0, e, y);
    }
  }
}
#else
// The portable loops, in the same order as the vector ones.
template <bool kInt4>
void group_times_portable(const QuantizedRows& a, int64_t M, int64_t nb, int64_t N, const uint8_t* group,
                          int64_t n0, const Epilogue& e, float* y) {
  constexpr int64_t kRec = record_bytes<kInt4>(), kCodes = code_bytes<kInt4>();
  const int64_t nbp = a.nbp, kp = nbp * kBlock;
  const int64_t lanes = std::min(kLanes, N - n0);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* x = a.codes.data() + m * kp;
    const float* dx = a.scale.data() + m * nbp;
    const float* sx = a.scaled_sum.data() + m * nbp;
    for (int64_t j = 0; j < lanes; ++j) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* r = group + b * kRec;
        const int8_t* xb = x + b * kBlock;
        int32_t dot = 0;
        for (int c = 0; c < kWords<kInt4>(); ++c)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = r[64 * c + 4 * j + i];
            if (kInt4) {
              dot += (byte & 0x0F) * xb[4 * c + i] + (byte >> 4) * xb[16 + 4 * c + i];
            } else {
              dot += static_cast<int8_t>(byte) * xb[4 * c + i];
            }
          }
        const float dw = half_to_float(load_u16(r + kCodes + 2 * j));
        acc = std::fma(static_cast<float>(dot), dw * dx[b], acc);
        if (kInt4) acc = std::fma(half_to_float(load_u16(r + kCodes + 32 + 2 * j)), sx[b], acc);
      }
      float v = acc;
      if (e.bias) v += e.bias[n0 + j];
      if (e.residual) v += e.residual[m * N + n0 + j];
      y[m * N + n0 + j] = v;
    }
  }
}
#endif

// y (M, N) = the quantised rows times the packed weight, bias and residual added.
template <bool kInt4>
void packed_product(const QuantizedRows& a, int64_t M, int64_t nb, int64_t N, const uint8_t* packed,
                    const Epilogue& e, float* y) {
  const int64_t groups = (N + kLanes - 1) / kLanes, group_bytes = nb * record_bytes<kInt4>();
  // Groups split over the threads (each thread streams its share of the weight once per call;
  // the next register block of activation rows reads the group again from L1/L2).
  at::parallel_for(0, groups, 1, [&](int64_t g_begin, int64_t g_end) {
    for (int64_t g = g_begin; g < g_end; ++g) {
      const uint8_t* group = packed + g * group_bytes;
#if defined(IMX_AVX2)
      int64_t m0 = 0;
      for (; m0 + kMaxRows <= M; m0 += kMaxRows) group_times<kInt4, kMaxRows>(a, nb, N, group, g * kLanes, m0, e, y);
      tail_rows<kInt4, kMaxRows - 1>(M - m0, a, nb, N, group, g * kLanes, m0, e, y);
#else
      group_times_portable<kInt4>(a, M, nb, N, group, g * kLanes, e, y);
#endif
    }
  });
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

// One block of a weight row dequantised from its GGUF bytes (int4: 16 bytes, int8: 32) to 32
// values of Out (fp32 or bf16): d * q (+ m), a multiply then an add in fp32 in both the vector
// and the portable loops.
template <bool kInt4, typename Out>
inline void dequantize_block(const uint8_t* p, float dw, float mw, Out* o) {
#ifdef IMX_AVX2
  const __m256 dv = _mm256_set1_ps(dw);
  if (kInt4) {
    const __m256 mv = _mm256_set1_ps(mw);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int c = 0; c < 4; ++c) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[c]));
      store8(o + 8 * c, _mm256_add_ps(_mm256_mul_ps(dv, q), mv));
    }
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m128i halves[2] = {_mm256_castsi256_si128(raw), _mm256_extracti128_si256(raw, 1)};
    for (int c = 0; c < 4; ++c) {
      const __m128i part = c % 2 == 0 ? halves[c / 2] : _mm_srli_si128(halves[c / 2], 8);
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part));
      store8(o + 8 * c, _mm256_mul_ps(dv, q));
    }
  }
#else
  if (kInt4) {
    for (int t = 0; t < 16; ++t) {
      o[t] = static_cast<Out>(dw * static_cast<float>(p[t] & 0x0F) + mw);
      o[t + 16] = static_cast<Out>(dw * static_cast<float>(p[t] >> 4) + mw);
    }
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(p);
    for (int t = 0; t < kBlock; ++t) o[t] = static_cast<Out>(dw * static_cast<float>(q[t]));
  }
#endif
}

// Rows n0..n1 of a weight in GGUF's block layout, dequantised: (n1 - n0, K).
template <bool kInt4, typename Out>
void dequantize_rows(int64_t K, const uint8_t* qw, const uint16_t* d, const uint16_t* mins, int64_t n0,
                     int64_t n1, Out* out) {
  const int64_t nb = K / kBlock;
  const int64_t row_bytes = kInt4 ? K / 2 : K;
  at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b)
        dequantize_block<kInt4, Out>(qw + n * row_bytes + b * (kInt4 ? 16 : kBlock), half_to_float(d[n * nb + b]),
                                     kInt4 ? half_to_float(mins[n * nb + b]) : 0.0f, out + (n - n0) * K + b * kBlock);
  });
}

// Rows n0..n1 of a packed weight, dequantised: (n1 - n0, nb * 32). A row's 4-byte words of a
// record are its block's GGUF bytes.
template <bool kInt4, typename Out>
void dequantize_packed(int64_t nb, const uint8_t* packed, int64_t n0, int64_t n1, Out* out) {
  constexpr int64_t kRec = record_bytes<kInt4>(), kCodes = code_bytes<kInt4>();
  const int64_t K = nb * kBlock;
  at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
    uint8_t raw[kBlock];
    for (int64_t n = begin; n < end; ++n) {
      const int64_t j = n % kLanes;
      const uint8_t* group = packed + (n / kLanes) * nb * kRec;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* r = group + b * kRec;
        for (int c = 0; c < kWords<kInt4>(); ++c) std::memcpy(raw + 4 * c, r + 64 * c + 4 * j, 4);
        const float dw = half_to_float(load_u16(r + kCodes + 2 * j));
        const float mw = kInt4 ? half_to_float(load_u16(r + kCodes + 32 + 2 * j)) : 0.0f;
        dequantize_block<kInt4, Out>(raw, dw, mw, out + (n - n0) * K + b * kBlock);
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

// The weight's blocks regrouped for the products (the layout above): (ceil(N / 16), K / 32,
// record bytes) uint8.
at::Tensor quant_pack(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins) {
  const bool int4 = qweight.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || qweight.scalar_type() == at::kChar, "quant_pack: qweight must be uint8 (int4) or int8");
  const int64_t K = int4 ? qweight.size(1) * 2 : qweight.size(1);
  check_weight(qweight, scales, mins, int4, K);
  const int64_t N = qweight.size(0), nb = K / kBlock, groups = (N + kLanes - 1) / kLanes;
  const int64_t rec = int4 ? record_bytes<true>() : record_bytes<false>();
  const int64_t codes = int4 ? code_bytes<true>() : code_bytes<false>();
  const int words = int4 ? kWords<true>() : kWords<false>();
  const int64_t row_bytes = int4 ? K / 2 : K, block_bytes = int4 ? 16 : kBlock;
  at::Tensor out = at::zeros({groups, nb, rec}, at::TensorOptions().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  const uint8_t* qw = static_cast<const uint8_t*>(qweight.data_ptr());
  const uint8_t* dp = reinterpret_cast<const uint8_t*>(scales.data_ptr<at::Half>());
  const uint8_t* mp = int4 ? reinterpret_cast<const uint8_t*>(mins->data_ptr<at::Half>()) : nullptr;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t j = 0; j < kLanes && g * kLanes + j < N; ++j) {
        const int64_t n = g * kLanes + j;
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* r = o + (g * nb + b) * rec;
          const uint8_t* src = qw + n * row_bytes + b * block_bytes;
          for (int c = 0; c < words; ++c) std::memcpy(r + 64 * c + 4 * j, src + 4 * c, 4);
          std::memcpy(r + codes + 2 * j, dp + 2 * (n * nb + b), 2);
          if (int4) std::memcpy(r + codes + 32 + 2 * j, mp + 2 * (n * nb + b), 2);
        }
      }
  });
  return out;
}

namespace {

// The format of a packed weight (its record size) and its K.
bool packed_int4(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "quant_linear: packed must be quant_pack's (groups, K/32, record) uint8 tensor");
  const int64_t rec = packed.size(2);
  TORCH_CHECK(rec == record_bytes<true>() || rec == record_bytes<false>(), "quant_linear: unknown record size ", rec);
  return rec == record_bytes<true>();
}

}  // namespace

// x: (M, K) fp32/bf16, or (M, 2K) with swiglu; packed: quant_pack's; returns (M, N) in x's dtype.
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                        const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                        const c10::optional<at::Tensor>& norm_weight, double eps, bool swiglu, int64_t dense_rows,
                        const c10::optional<at::Tensor>& rope_cos, const c10::optional<at::Tensor>& rope_sin,
                        int64_t rope_cols) {
  TORCH_CHECK(x_in.dim() == 2, "quant_linear: x must be 2-D");
  const bool int4 = packed_int4(packed);
  const int64_t nb = packed.size(1);
  TORCH_CHECK(N > (packed.size(0) - 1) * kLanes && N <= packed.size(0) * kLanes,
              "quant_linear: ", packed.size(0), " groups of 16 rows do not hold N = ", N);
  const int64_t M = x_in.size(0);
  const int64_t K = swiglu ? x_in.size(1) / 2 : x_in.size(1);
  TORCH_CHECK(!swiglu || x_in.size(1) == 2 * K, "quant_linear: swiglu input must have 2K columns");
  TORCH_CHECK(K == nb * kBlock, "quant_linear: x has K = ", K, ", the weight ", nb * kBlock);
  TORCH_CHECK(!(swiglu && norm_weight.has_value() && norm_weight->defined()),
              "quant_linear: norm_weight and swiglu are exclusive");
  const at::ScalarType out_dtype = x_in.scalar_type();
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor nw;
  const float* nwp = nullptr;
  if (norm_weight.has_value() && norm_weight->defined()) {
    nw = norm_weight->to(at::kFloat).contiguous();
    TORCH_CHECK(nw.numel() == K, "quant_linear: norm_weight must have K values");
    nwp = nw.data_ptr<float>();
  }
  const uint8_t* pw = packed.data_ptr<uint8_t>();
  at::Tensor y;
  bool added = false;  // bias and residual already in y
  if (M == 0) {
    y = at::empty({0, N}, x.options());
  } else if (dense_rows > 0 && M >= dense_rows) {
    // Many rows: dequantised weight tiles times the input in the input's dtype. The input is
    // quantised to int8 blocks and back first, so the arithmetic is the int8 dot products' up
    // to float rounding: a token's logits hardly depend on how many rows its step has.
    QuantizedRows a;
    prepare_rows(x, K, nwp, eps, swiglu, a);
    at::Tensor h = at::empty({M, K}, x.options());
    {
      float* hp = h.data_ptr<float>();
      const int64_t nbp = a.nbp;
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
    constexpr int64_t kTileRows = 512;  // a multiple of the 16 rows of a group
    at::Tensor tile = at::empty({std::min<int64_t>(kTileRows, N), K}, h.options());
    for (int64_t n0 = 0; n0 < N; n0 += kTileRows) {
      const int64_t n1 = std::min(N, n0 + kTileRows);
      at::Tensor wt = tile.narrow(0, 0, n1 - n0);
      if (bf16) {
        at::BFloat16* w = wt.data_ptr<at::BFloat16>();
        int4 ? dequantize_packed<true>(nb, pw, n0, n1, w) : dequantize_packed<false>(nb, pw, n0, n1, w);
      } else {
        float* w = wt.data_ptr<float>();
        int4 ? dequantize_packed<true>(nb, pw, n0, n1, w) : dequantize_packed<false>(nb, pw, n0, n1, w);
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
    int4 ? packed_product<true>(a, M, nb, N, pw, e, y.data_ptr<float>())
         : packed_product<false>(a, M, nb, N, pw, e, y.data_ptr<float>());
    added = true;
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

// A weight in GGUF's block layout as fp32 (N, K): the reference of tests.
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

// A packed weight as fp32 (N, K): what the products multiply (tests, sensitivity).
at::Tensor packed_dequantize(const at::Tensor& packed, int64_t N) {
  const bool int4 = packed_int4(packed);
  const int64_t nb = packed.size(1);
  TORCH_CHECK(N > (packed.size(0) - 1) * kLanes && N <= packed.size(0) * kLanes, "packed_dequantize: bad N ", N);
  at::Tensor out = at::empty({N, nb * kBlock}, at::TensorOptions().dtype(at::kFloat));
  int4 ? dequantize_packed<true>(nb, packed.data_ptr<uint8_t>(), 0, N, out.data_ptr<float>())
       : dequantize_packed<false>(nb, packed.data_ptr<uint8_t>(), 0, N, out.data_ptr<float>());
  return out;
}

std::string isa() {
#if defined(IMX_ZMM)
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
  m.def("quant_pack", &quant_pack, "the weight's blocks regrouped for quant_linear", pybind11::arg("qweight"),
        pybind11::arg("scales"), pybind11::arg("mins") = pybind11::none());
  m.def("quant_linear", &quant_linear, "y = f(x) @ W^T (+ bias) (+ residual), W packed by quant_pack",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("residual") = pybind11::none(),
        pybind11::arg("norm_weight") = pybind11::none(), pybind11::arg("eps") = 1e-6,
        pybind11::arg("swiglu") = false, pybind11::arg("dense_rows") = 0, pybind11::arg("rope_cos") = pybind11::none(),
        pybind11::arg("rope_sin") = pybind11::none(), pybind11::arg("rope_cols") = 0);
  m.def("quant_dequantize", &quant_dequantize, "a GGUF-layout weight as fp32 (N, K)", pybind11::arg("qweight"),
        pybind11::arg("scales"), pybind11::arg("mins") = pybind11::none());
  m.def("packed_dequantize", &packed_dequantize, "a packed weight as fp32 (N, K)", pybind11::arg("packed"),
        pybind11::arg("out_features"));
  m.def("isa", &isa, "the instruction set this build's products use");
}
