// Decode attention over the paged KV cache for the core engine's CPU path: one new query token
// per sequence, K/V read in place through the block table (no gather into a dense copy).
//
// Layout: that of core_engine/kernels/paged_attention.py.
//   q (S, n_heads, hd) fp32/bf16, last dim contiguous; out (S, n_heads, hd) in q's dtype.
//   k_cache, v_cache (num_blocks, block_size, n_kv, hd) fp32/bf16, or int8 codes with
//   k_scale, v_scale (num_blocks, n_kv) fp32 (value = code * scale).
//   block_tables (S, max_blocks) int32; context_lens (S,) int32, each in 1..max_blocks * block_size.
//   window (0: none): the query at position len - 1 sees only keys len - window .. len - 1;
//   softcap (0: none): scaled scores s become softcap * tanh(s / softcap) before the softmax.
//
// One task per sequence (or per range of its kv heads when there are fewer sequences than
// threads); the G = n_heads / n_kv query heads of a kv head are scored together, so each K/V
// row is read (and converted to fp32) once for all G. Softmax is online over blocks (running
// max and sum per query head, the accumulator rescaled when the max grows), all in fp32. An int8 block's scales fold into the scores (k) and the
// probabilities (v), so codes are only converted, never multiplied element by element.
// A window starts the read at key max(0, len - window): whole blocks before it are skipped and
// the first block read is entered at that key's offset, so no score is computed to be masked.
// Soft-capping runs scalar tanhf over a block's scores; without it the loops are unchanged.
// With AVX2 + FMA (also on AVX-512 CPUs; -march=native) and head_dim a multiple of 8 the dot
// products, the exps and the weighted V sums run on 8-float vectors, else on scalar loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
#endif

namespace {

// Fewer (token, kv head) rows than this in a chunk of tasks are not worth waking another
// thread for (~40 us of work at head_dim 64, G 3).
constexpr int64_t kMinRowsPerChunk = 1024;
constexpr float kExpFloor = -87.0f;  // exp below it is under 2^-126: not a normal float

// exp(x) for x <= 0 (scores minus their running max), ~1e-7 relative error: Cephes' expf
// (x = n ln2 + r, |r| <= ln2 / 2, a polynomial in r, times 2^n built in the exponent bits).
// libm's expf, one call per score, was most of the kernel's time.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  x = std::max(x, kExpFloor);
  const float n = std::floor(x * kLog2e + 0.5f);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  const float e = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return e * two_n;
}

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(uint16_t bf16) {  // bf16 bits: the upper half of a float's
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Scalar versions of the three steps of a block (any head_dim, any CPU).

// p[g * P + t] = k_mul * <q_g, k_t> for g < G, t < n.
template <typename CT>
void block_scores_scalar(const float* qf, int64_t G, int64_t D, const CT* k, int64_t c_t, int64_t n,
                         float k_mul, float* p, int64_t P) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * to_float(k[t * c_t + d]);
      p[g * P + t] = s * k_mul;
    }
  }
}

// acc[g] += sum_t p[g * P + t] * v_t for g < G.
template <typename CT>
void block_accumulate_scalar(const float* p, int64_t P, int64_t G, int64_t D, const CT* v, int64_t c_t,
                             int64_t n, float* acc) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const float pt = p[g * P + t];
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += pt * to_float(v[t * c_t + d]);
    }
  }
}

// p[t] = exp(p[t] - m) for t < n.
void exp_shifted_scalar(float* p, int64_t n, float m) {
  for (int64_t t = 0; t < n; ++t) p[t] = exp_nonpositive(p[t] - m);
}

#ifdef PD_AVX2
// The same with 8 floats a vector, head_dim a multiple of 8; up to 4 query heads at a time
// share each load of a K or V row (converted to fp32 in registers).

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(kExpFloor), x);  // this operand order keeps a NaN
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256 e = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}

template <int NG, typename CT>
inline void row_scores8(const float* qf, int64_t D, const CT* k, float k_mul, float* p, int64_t P) {
  __m256 acc[NG];
  for (int g = 0; g < NG; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 kv = load8(k + d);
    for (int g = 0; g < NG; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + d), kv, acc[g]);
  }
  for (int g = 0; g < NG; ++g) p[g * P] = k_mul * hsum(acc[g]);
}

template <int NG, typename CT>
inline void accumulate8(const float* p, int64_t P, int64_t D, const CT* v, int64_t c_t, int64_t n, float* acc) {
  for (int64_t d = 0; d < D; d += 8) {
    __m256 a[NG];
    for (int g = 0; g < NG; ++g) a[g] = _mm256_loadu_ps(acc + g * D + d);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 vv = load8(v + t * c_t + d);
      for (int g = 0; g < NG; ++g) a[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * P + t]), vv, a[g]);
    }
    for (int g = 0; g < NG; ++g) _mm256_storeu_ps(acc + g * D + d, a[g]);
  }
}

template <typename CT>
void block_scores8(const float* qf, int64_t G, int64_t D, const CT* k, int64_t c_t, int64_t n, float k_mul,
                   float* p, int64_t P) {
  for (int64_t t = 0; t < n; ++t) {
    const CT* row = k + t * c_t;
    for (int64_t g = 0; g < G; g += 4) {
      const float* qg = qf + g * D;
      float* pg = p + g * P + t;
      switch (std::min<int64_t>(4, G - g)) {
        case 4: row_scores8<4>(qg, D, row, k_mul, pg, P); break;
        case 3: row_scores8<3>(qg, D, row, k_mul, pg, P); break;
        case 2: row_scores8<2>(qg, D, row, k_mul, pg, P); break;
        default: row_scores8<1>(qg, D, row, k_mul, pg, P); break;
      }
    }
  }
}

template <typename CT>
void block_accumulate8(const float* p, int64_t P, int64_t G, int64_t D, const CT* v, int64_t c_t, int64_t n,
                       float* acc) {
  for (int64_t g = 0; g < G; g += 4) {
    const float* pg = p + g * P;
    float* ag = acc + g * D;
    switch (std::min<int64_t>(4, G - g)) {
      case 4: accumulate8<4>(pg, P, D, v, c_t, n, ag); break;
      case 3: accumulate8<3>(pg, P, D, v, c_t, n, ag); break;
      case 2: accumulate8<2>(pg, P, D, v, c_t, n, ag); break;
      default: accumulate8<1>(pg, P, D, v, c_t, n, ag); break;
    }
  }
}

// Whole vectors up to n rounded up to 8: p has room (P is a multiple of 8), the extra
// entries are never read.
void exp_shifted8(float* p, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t t = 0; t < n; t += 8) _mm256_storeu_ps(p + t, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(p + t), mv)));
}
#endif  // PD_AVX2

// Ask for the next block's rows of a kv head while the current block is computed: blocks
// are scattered over the pool, which the hardware prefetchers cannot guess (16 sequences of
// 512 tokens, 12 MiB a layer: 3.8 instead of 4.9 ms on a 2-core EPYC; no change in cache).
template <typename CT>
inline void prefetch_rows(const CT* rows, int64_t c_t, int64_t n, int64_t D) {
  const char* base = reinterpret_cast<const char*>(rows);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(CT)), stride = c_t * static_cast<int64_t>(sizeof(CT));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(base + t * stride + b);
  }
}

template <typename QT>
inline float load_q(const QT* p) {
  return static_cast<float>(*p);
}

struct Problem {
  int64_t num_seqs, n_heads, n_kv, group, head_dim, block_size, max_blocks;
  int64_t q_s, q_h;            // q strides (elements)
  int64_t c_b, c_t, c_h;       // cache strides (block, token, head)
  int64_t bt_s;                // block table row stride
  const int32_t* tables;
  const int32_t* lens;
  const float* k_scale;        // (num_blocks, n_kv) contiguous, or null
  const float* v_scale;
  float scale;
  int64_t window;              // 0: none
  float softcap;               // 0: none
};

// The first key a sequence of len tokens reads (its window's start).
inline int64_t first_key(const Problem& pb, int64_t len) {
  return pb.window > 0 ? std::max<int64_t>(0, len - pb.window) : 0;
}

// p[g * P + t] = cap * tanh(p[g * P + t] / cap) for g < G, t < n.
void softcap_scores(float* p, int64_t P, int64_t G, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < n; ++t) p[g * P + t] = cap * std::tanh(p[g * P + t] * inv);
  }
}

template <typename CT, typename QT, bool kVec>
void run(const Problem& pb, const CT* k_cache, const CT* v_cache, const QT* q, QT* out) {
  const int64_t G = pb.group, D = pb.head_dim, BS = pb.block_size;
  const int64_t P = (BS + 7) / 8 * 8;  // row stride of the block's scores
  // A task is one sequence and a range of its kv heads: all of them (each block's K and V
  // then read whole, in order) unless there are fewer sequences than threads.
  const int64_t splits = std::min<int64_t>(pb.n_kv, (at::get_num_threads() + pb.num_seqs - 1) / pb.num_seqs);
  const int64_t heads_per_task = (pb.n_kv + splits - 1) / splits;
  const int64_t tasks_per_seq = (pb.n_kv + heads_per_task - 1) / heads_per_task;
  const int64_t num_tasks = pb.num_seqs * tasks_per_seq;
  int64_t rows = 0;
  for (int64_t s = 0; s < pb.num_seqs; ++s) rows += pb.lens[s] - first_key(pb, pb.lens[s]);
  rows *= pb.n_kv;
  // Chunks of at least kMinRowsPerChunk rows on average (a small step stays on this thread).
  const int64_t grain = std::max<int64_t>(1, (kMinRowsPerChunk * num_tasks + rows - 1) / std::max<int64_t>(rows, 1));
  at::parallel_for(0, num_tasks, grain, [&](int64_t begin, int64_t end) {
    const int64_t R = heads_per_task * G;  // query rows of a task
    std::vector<float> buf(static_cast<size_t>(2 * R * D + 2 * R + G * P));
    float* qf = buf.data();        // (R, D) queries in fp32
    float* acc = qf + R * D;       // (R, D) unnormalised outputs
    float* m = acc + R * D;        // (R) running max of the scores
    float* l = m + R;              // (R) running sum of exp(score - m)
    float* p = l + R;              // (G, P) one head's scores of a block, then its weights
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / tasks_per_seq;
      const int64_t h0 = task % tasks_per_seq * heads_per_task, h1 = std::min(pb.n_kv, h0 + heads_per_task);
      const int64_t len = pb.lens[s];
      const int32_t* table = pb.tables + s * pb.bt_s;
      for (int64_t r = 0; r < (h1 - h0) * G; ++r) {
        const QT* qrow = q + s * pb.q_s + (h0 * G + r) * pb.q_h;
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = load_q(qrow + d);
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.0f;
      }
      std::fill(acc, acc + R * D, 0.0f);
      const int64_t num_blocks = (len + BS - 1) / BS;
      const int64_t first = first_key(pb, len);
      for (int64_t bi = first / BS; bi < num_blocks; ++bi) {
        const int64_t block = table[bi];
        const int64_t t0 = bi == first / BS ? first % BS : 0;  // the block's first key read
        const int64_t n = std::min(BS, len - bi * BS) - t0;
        if (bi + 1 < num_blocks) {
          const int64_t next_n = std::min(BS, len - (bi + 1) * BS);
          for (int64_t h = h0; h < h1; ++h) {
            const int64_t next = table[bi + 1] * pb.c_b + h * pb.c_h;
            prefetch_rows(k_cache + next, pb.c_t, next_n, D);
            prefetch_rows(v_cache + next, pb.c_t, next_n, D);
          }
        }
        for (int64_t h = h0; h < h1; ++h) {
          const CT* k = k_cache + block * pb.c_b + t0 * pb.c_t + h * pb.c_h;
          const CT* v = v_cache + block * pb.c_b + t0 * pb.c_t + h * pb.c_h;
          const float k_mul = pb.k_scale ? pb.scale * pb.k_scale[block * pb.n_kv + h] : pb.scale;
          const float v_mul = pb.v_scale ? pb.v_scale[block * pb.n_kv + h] : 1.0f;
          const int64_t r0 = (h - h0) * G;  // this head's first query row in the task
          float* acc_h = acc + r0 * D;
#ifdef PD_AVX2
          if constexpr (kVec) {
            block_scores8(qf + r0 * D, G, D, k, pb.c_t, n, k_mul, p, P);
          } else
#endif
            block_scores_scalar(qf + r0 * D, G, D, k, pb.c_t, n, k_mul, p, P);
          if (pb.softcap > 0.0f) softcap_scores(p, P, G, n, pb.softcap);
          for (int64_t g = 0; g < G; ++g) {
            float* pg = p + g * P;
            float& mg = m[r0 + g];
            float block_max = pg[0];
            for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, pg[t]);
            if (block_max > mg) {  // rescale what was summed under the old max
              const float alpha = std::exp(mg - block_max);  // 0 on the first block
              l[r0 + g] *= alpha;
              for (int64_t d = 0; d < D; ++d) acc_h[g * D + d] *= alpha;
              mg = block_max;
            }
#ifdef PD_AVX2
            if constexpr (kVec) {
              exp_shifted8(pg, n, mg);
            } else
#endif
              exp_shifted_scalar(pg, n, mg);
            float sum = 0.0f;
            for (int64_t t = 0; t < n; ++t) {
              sum += pg[t];
              pg[t] *= v_mul;  // an int8 block's value scale, folded into its weights
            }
            l[r0 + g] += sum;
          }
#ifdef PD_AVX2
          if constexpr (kVec) {
            block_accumulate8(p, P, G, D, v, pb.c_t, n, acc_h);
          } else
#endif
            block_accumulate_scalar(p, P, G, D, v, pb.c_t, n, acc_h);
        }
      }
      for (int64_t r = 0; r < (h1 - h0) * G; ++r) {
        const float inv = 1.0f / l[r];
        QT* orow = out + (s * pb.n_heads + h0 * G + r) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<QT>(acc[r * D + d] * inv);
      }
    }
  });
}

template <typename CT, typename QT>
void run_any(const Problem& pb, const CT* k, const CT* v, const QT* q, QT* out) {
#ifdef PD_AVX2
  if (pb.head_dim % 8 == 0) return run<CT, QT, true>(pb, k, v, q, out);
#endif
  run<CT, QT, false>(pb, k, v, q, out);
}

template <typename QT>
void dispatch_cache(const Problem& pb, const at::Tensor& k, const at::Tensor& v, const QT* q, QT* out) {
  switch (k.scalar_type()) {
    case at::kFloat:
      run_any<float, QT>(pb, k.data_ptr<float>(), v.data_ptr<float>(), q, out);
      break;
    case at::kBFloat16:
      run_any<uint16_t, QT>(pb, reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                        reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), q, out);
      break;
    case at::kChar:
      run_any<int8_t, QT>(pb, k.data_ptr<int8_t>(), v.data_ptr<int8_t>(), q, out);
      break;
    default:
      TORCH_CHECK_VALUE(false, "paged_decode: k_cache must be float32, bfloat16 or int8, got ", k.scalar_type());
  }
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        const c10::optional<at::Tensor>& k_scale_in, const c10::optional<at::Tensor>& v_scale_in,
                        int64_t window, double softcap) {
  TORCH_CHECK_VALUE(q_in.dim() == 3, "paged_decode: q must be (num_seqs, n_heads, head_dim)");
  TORCH_CHECK_VALUE(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16,
                    "paged_decode: q must be float32 or bfloat16, got ", q_in.scalar_type());
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes(),
                    "paged_decode: k_cache and v_cache must be (num_blocks, block_size, n_kv_heads, ", D, ")");
  TORCH_CHECK_VALUE(v_cache.scalar_type() == k_cache.scalar_type() && v_cache.strides() == k_cache.strides() &&
                        k_cache.stride(3) == 1,
                    "paged_decode: k_cache and v_cache must share dtype and strides, head_dim contiguous");
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), NKV = k_cache.size(2);
  TORCH_CHECK_VALUE(NKV > 0 && H % NKV == 0, "paged_decode: n_heads ", H, " is not a multiple of n_kv_heads ", NKV);
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == S && block_tables.scalar_type() == at::kInt &&
                        block_tables.stride(1) == 1,
                    "paged_decode: block_tables must be (", S, ", max_blocks) int32, rows contiguous");
  TORCH_CHECK_VALUE(context_lens.dim() == 1 && context_lens.size(0) == S && context_lens.scalar_type() == at::kInt,
                    "paged_decode: context_lens must be (", S, ",) int32");
  TORCH_CHECK_VALUE(window >= 0, "paged_decode: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK_VALUE(softcap >= 0.0, "paged_decode: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK_VALUE(k_scale_in.has_value() == v_scale_in.has_value(), "paged_decode: pass k_scale and v_scale together");
  const bool is_code = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(is_code == k_scale_in.has_value(), "paged_decode: int8 caches need k_scale/v_scale, others none");
  at::Tensor k_scale, v_scale;
  if (is_code) {
    k_scale = k_scale_in->contiguous();
    v_scale = v_scale_in->contiguous();
    for (const at::Tensor* t : {&k_scale, &v_scale}) {
      TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == NB && t->size(1) == NKV && t->scalar_type() == at::kFloat,
                        "paged_decode: k_scale/v_scale must be (", NB, ", ", NKV, ") float32");
    }
  }
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_tables, &context_lens}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "paged_decode: all tensors must be on the CPU");
  }
  const at::Tensor lens = context_lens.contiguous();
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  // Every block a sequence reads must be in the pool: a bad table would read out of bounds.
  for (int64_t s = 0; s < S; ++s) {
    const int64_t len = lp[s];
    TORCH_CHECK_VALUE(len >= 1 && len <= max_blocks * BS, "paged_decode: context_lens[", s, "] = ", len,
                      " outside 1..", max_blocks * BS);
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    for (int64_t bi = first / BS; bi < (len + BS - 1) / BS; ++bi) {
      const int32_t block = tp[s * block_tables.stride(0) + bi];
      TORCH_CHECK_VALUE(block >= 0 && block < NB, "paged_decode: block_tables[", s, ", ", bi, "] = ", block,
                        " outside 0..", NB - 1);
    }
  }
  Problem pb{S, H, NKV, H / NKV, D, BS, max_blocks,
             q.stride(0), q.stride(1),
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
             block_tables.stride(0), tp, lp,
             is_code ? k_scale.data_ptr<float>() : nullptr, is_code ? v_scale.data_ptr<float>() : nullptr,
             static_cast<float>(scale), window, static_cast<float>(softcap)};
  at::Tensor out = at::empty({S, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.scalar_type() == at::kFloat) {
    dispatch_cache<float>(pb, k_cache, v_cache, q.data_ptr<float>(), out.data_ptr<float>());
  } else {
    dispatch_cache<at::BFloat16>(pb, k_cache, v_cache, q.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  }
  return out;
}

// A plain Python function (pybind11), not a dispatcher op: a few us per call, once per layer.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (see the file's header)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("k_scale") = pybind11::none(),
        pybind11::arg("v_scale") = pybind11::none(), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0);
}
