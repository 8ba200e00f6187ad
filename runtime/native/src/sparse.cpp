#include "sparse.h"

#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace ucm::sparse {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      u = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_f16(float f) {  // round to nearest even, saturating to inf
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past the largest half
  if (abs < 0x38800000u) {  // a half subnormal (or zero)
    const float scaled = std::fabs(f) * 16777216.0f;  // 2^24: units of the smallest subnormal
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

inline float load(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::F32:
      return static_cast<const float*>(base)[i];
    case DType::BF16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default:
      return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

inline void store(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::F32:
      static_cast<float*>(base)[i] = v;
      break;
    case DType::BF16:
      static_cast<uint16_t*>(base)[i] = float_to_bf16(v);
      break;
    default:
      static_cast<uint16_t*>(base)[i] = float_to_f16(v);
  }
}

// Elements base[at(i)] (i < n) as floats: one dtype dispatch per row, not per element.
template <typename At>
void to_floats(const void* base, DType t, int64_t n, At at, float* out) {
  switch (t) {
    case DType::F32: {
      const float* p = static_cast<const float*>(base);
      for (int64_t i = 0; i < n; ++i) out[i] = p[at(i)];
      break;
    }
    case DType::BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base);
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(p[at(i)]);
      break;
    }
    default: {
      const uint16_t* p = static_cast<const uint16_t*>(base);
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_float(p[at(i)]);
    }
  }
}

// n consecutive elements as floats.
void load_row(const void* base, DType t, int64_t offset, int64_t n, float* out) {
#if defined(__F16C__)
  if (t == DType::F16) {  // 8 at a time in hardware (KVStar keeps its representations in float16)
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
    for (; i < n; ++i) out[i] = f16_to_float(p[i]);
    return;
  }
#endif
  to_floats(base, t, n, [offset](int64_t i) { return offset + i; }, out);
}

// Elements offset + positions[i] (i < n) as floats.
void gather_row(const void* base, DType t, int64_t offset, const int32_t* positions, int64_t n, float* out) {
  to_floats(base, t, n, [offset, positions](int64_t i) { return offset + positions[i]; }, out);
}

// exp(x) for x <= 0, to ~1e-6 relative; a branch-free polynomial the compiler vectorizes.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504f;  // log2(e)
  const float fl = std::floor(t);
  const float f = t - fl;
  // 2^f on [0, 1): minimax polynomial
  const float p = 1.0f + f * (0.693147182f + f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f +
                                                                                           f * 0.00133335581f))));
  const int32_t e = static_cast<int32_t>(fl) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes, the same operations in the same order (so the same bits).
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 fl = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fl);
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.00133335581f), _mm512_set1_ps(0.00961812911f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.0555041087f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.240226507f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.693147182f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(fl), _mm512_set1_epi32(127));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// exp_nonpositive on 8 lanes, the same operations in the same order (so the same bits).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
  const __m256 fl = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, fl);
  __m256 p = _mm256_fmadd_ps(f, _mm256_set1_ps(0.00133335581f), _mm256_set1_ps(0.00961812911f));
  p = _mm256_fmadd_ps(f, p, _mm256_set1_ps(0.0555041087f));
  p = _mm256_fmadd_ps(f, p, _mm256_set1_ps(0.240226507f));
  p = _mm256_fmadd_ps(f, p, _mm256_set1_ps(0.693147182f));
  p = _mm256_fmadd_ps(f, p, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fl), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

inline float reduce8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

// x[i] = exp((x[i] - max x) * temperature) for the n scores of one head; returns their sum. (GCC
// leaves the scalar loops unvectorized: with them this was a third of the selection's time.)
float softmax_terms(float* x, int64_t n, float temperature) {
  float top = -kInf, total = 0.0f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  __m256 vtop = _mm256_set1_ps(-kInf), vtotal = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) vtop = _mm256_max_ps(vtop, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vtop);
  for (const float v : lanes) top = std::max(top, v);
  for (int64_t j = i; j < n; ++j) top = std::max(top, x[j]);
  const __m256 vmax = _mm256_set1_ps(top), vt = _mm256_set1_ps(temperature);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 v = exp_nonpositive8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax), vt));
    _mm256_storeu_ps(x + i, v);
    vtotal = _mm256_add_ps(vtotal, v);
  }
  total = reduce8(vtotal);
#elif defined(__AVX512F__)
  __m512 vtop = _mm512_set1_ps(-kInf), vtotal = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) vtop = _mm512_max_ps(vtop, _mm512_loadu_ps(x + i));
  top = _mm512_reduce_max_ps(vtop);
  for (int64_t j = i; j < n; ++j) top = std::max(top, x[j]);
  const __m512 vmax = _mm512_set1_ps(top), vt = _mm512_set1_ps(temperature);
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 v = exp_nonpositive16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vmax), vt));
    _mm512_storeu_ps(x + i, v);
    vtotal = _mm512_add_ps(vtotal, v);
  }
  total = _mm512_reduce_add_ps(vtotal);
#else
  for (int64_t j = 0; j < n; ++j) top = std::max(top, x[j]);
#endif
  for (; i < n; ++i) {
    x[i] = exp_nonpositive((x[i] - top) * temperature);
    total += x[i];
  }
  return total;
}

// A float's bits as an unsigned key that orders as the floats do (negatives reversed below positives).
inline uint32_t order_key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

// The k-th largest of the n keys (1 <= k <= n): the largest key with at least k keys at or above
// it, found bit by bit (counting passes the compiler vectorizes, where a partial sort branches on
// every element). Once exactly k keys lie at or above the bits found so far, the k-th largest is
// the smallest of them: one pass ends the search (on float scores after about a dozen bits rather
// than 32; the passes were a tenth of the selection's time).
uint32_t kth_largest(const uint32_t* keys, int64_t n, int64_t k) {
  uint32_t found = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t candidate = found | (1u << bit);
    int32_t at_least = 0;  // 16 lanes of counts where int64 would give 8
#pragma omp simd reduction(+ : at_least)
    for (int64_t i = 0; i < n; ++i) at_least += keys[i] >= candidate;
    if (at_least < k) continue;
    found = candidate;
    if (at_least == k) {
      uint32_t smallest = ~0u;
#pragma omp simd reduction(min : smallest)
      for (int64_t i = 0; i < n; ++i) smallest = std::min(smallest, keys[i] >= found ? keys[i] : ~0u);
      return smallest;
    }
  }
  return found;
}

// Writes ``table[blk] * hkv + h`` for the blocks to keep, ascending: those whose key is above
// ``cut``, and the first ``ties`` of those equal to it. Returns how many were written.
int64_t take_blocks(const uint32_t* keys, const int32_t* table, int64_t n, uint32_t cut, int64_t ties, int32_t hkv,
                    int32_t h, int32_t* out) {
  int64_t i = 0, blk = 0;
#if defined(__AVX512F__)
  const __m512i vcut = _mm512_set1_epi32(static_cast<int32_t>(cut)), vh = _mm512_set1_epi32(h);
  const __m512i vhkv = _mm512_set1_epi32(hkv);
  for (; blk + 16 <= n; blk += 16) {
    const __m512i k = _mm512_loadu_si512(keys + blk);
    __mmask16 take = _mm512_cmpgt_epu32_mask(k, vcut);
    __mmask16 equal = _mm512_cmpeq_epu32_mask(k, vcut);
    for (; equal && ties > 0; --ties) {  // the lowest tying blocks first
      take |= equal & -equal;
      equal &= equal - 1;
    }
    const __m512i ids = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_loadu_si512(table + blk), vhkv), vh);
    _mm512_mask_compressstoreu_epi32(out + i, take, ids);
    i += __builtin_popcount(take);
  }
#endif
  for (; blk < n; ++blk) {
    const bool take = keys[blk] > cut || (keys[blk] == cut && ties-- > 0);
    if (take) out[i++] = table[blk] * hkv + h;
  }
  return i;
}

// Sign bits of x @ projection (D x bits, row-major), packed 8 per byte (bit i of byte j: column 8j+i).
void hash_key(const float* x, const float* projection, int64_t d, int64_t bytes, uint8_t* out) {
  const int64_t bits = bytes * 8;
  float proj[512];
  for (int64_t c = 0; c < bits; ++c) proj[c] = 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    const float xi = x[i];
    const float* row = projection + i * bits;
    for (int64_t c = 0; c < bits; ++c) proj[c] += xi * row[c];
  }
  for (int64_t j = 0; j < bytes; ++j) {
    uint8_t byte = 0;
    for (int b = 0; b < 8; ++b) byte |= static_cast<uint8_t>(proj[j * 8 + b] > 0.0f) << b;
    out[j] = byte;
  }
}

int popcount_xor(const uint8_t* a, const uint8_t* b, int64_t bytes) {
  int n = 0;
  int64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t x, y;
    std::memcpy(&x, a + i, 8);
    std::memcpy(&y, b + i, 8);
    n += __builtin_popcountll(x ^ y);
  }
  for (; i < bytes; ++i) n += __builtin_popcount(static_cast<unsigned>(a[i] ^ b[i]));
  return n;
}

void check(const Summaries& s) {
  if (s.head_dim > 512 || s.hash_bytes * 8 > 512) throw std::invalid_argument("head_dim and hash bits: at most 512");
  const bool bound = s.mode == Mode::Bound || s.mode == Mode::Both;
  const bool mean = s.mode == Mode::Mean || s.mode == Mode::Both;
  if (bound && (!s.lo || !s.hi || !s.rep)) throw std::invalid_argument("bound summaries need lo, hi and rep");
  if (mean && (!s.mean || !s.rep)) throw std::invalid_argument("mean summaries need mean and rep");
  if (s.mode == Mode::Hash && (!s.hashes || !s.projection || s.hash_bytes < 1))
    throw std::invalid_argument("hash summaries need hashes, a projection and hash_bytes");
  if (s.rep_dtype == DType::U8 && (s.mode != Mode::Bound || !s.rep_scale))
    throw std::invalid_argument("quantized (u8) representations: bound summaries only, with rep_scale");
}

// Vectors of D in one (block, head)'s representation.
int64_t rep_width(Mode mode) { return mode == Mode::Both ? 3 : mode == Mode::Bound ? 2 : 1; }

// One (block, head)'s summary as floats while keys are folded into it.
struct Running {
  float mean[512], lo[512], hi[512];
};

// Fold one key (D floats) into `r`, the key being the block's `offset`-th (offset 0 starts afresh).
void accumulate(Running& r, Mode mode, int64_t d, int64_t offset, const float* key) {
  const bool mean = mode == Mode::Mean || mode == Mode::Both, bound = mode == Mode::Bound || mode == Mode::Both;
  if (offset == 0) {
    if (mean) std::memcpy(r.mean, key, d * sizeof(float));
    if (bound) {
      std::memcpy(r.lo, key, d * sizeof(float));
      std::memcpy(r.hi, key, d * sizeof(float));
    }
    return;
  }
  if (mean) {
    const float w = 1.0f / static_cast<float>(offset + 1);
    for (int64_t i = 0; i < d; ++i) r.mean[i] += (key[i] - r.mean[i]) * w;
  }
  if (bound) {
    for (int64_t i = 0; i < d; ++i) {
      r.lo[i] = std::min(r.lo[i], key[i]);
      r.hi[i] = std::max(r.hi[i], key[i]);
    }
  }
}

// Block p, head h's summary as stored (lo and hi in the cache's dtype), as floats.
void read_running(const Summaries& s, int64_t p, int64_t h, Running& r) {
  const int64_t d = s.head_dim, at = (p * s.kv_heads + h) * d;
  if (s.mode == Mode::Mean || s.mode == Mode::Both) std::memcpy(r.mean, s.mean + at, d * sizeof(float));
  if (s.mode == Mode::Bound || s.mode == Mode::Both) {
    load_row(s.lo, s.dtype, at, d, r.lo);
    load_row(s.hi, s.dtype, at, d, r.hi);
  }
}

// [c | r] (D floats each) as bytes [c_q + 128 | r_q] and their scale (see sparse.h). The scale is
// the larger of max|c| / 127 and max r / 254: a centre rounds by at most half a step, so r plus that
// error stays within 254.5 steps and r_q within 255.
void quantize_bound(const float* c, const float* r, int64_t d, uint8_t* out, float& scale) {
  float top_c = 0.0f, top_r = 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    top_c = std::max(top_c, std::fabs(c[i]));
    top_r = std::max(top_r, r[i]);
  }
  const float s = std::max(top_c / 127.0f, top_r / 254.0f);
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    const float cq = std::clamp(std::nearbyint(c[i] * inv), -127.0f, 127.0f);
    const float error = std::fabs(c[i] - s * cq);
    out[i] = static_cast<uint8_t>(cq + 128.0f);
    out[d + i] = static_cast<uint8_t>(std::min(255.0f, std::ceil((r[i] + error) * inv)));
  }
  scale = s;
}

// Store `r` as block p, head h's summary and derive its representation.
void publish(const Summaries& s, int64_t p, int64_t h, const Running& r) {
  const int64_t d = s.head_dim, at = (p * s.kv_heads + h) * d;
  int64_t next = at * rep_width(s.mode);  // where the next part of the representation goes
  if (s.mode == Mode::Mean || s.mode == Mode::Both) {
    std::memcpy(s.mean + at, r.mean, d * sizeof(float));
    for (int64_t i = 0; i < d; ++i) store(s.rep, s.rep_dtype, next + i, r.mean[i]);
    next += d;
  }
  if (s.mode == Mode::Bound || s.mode == Mode::Both) {
    float c[512], radius[512];
    for (int64_t i = 0; i < d; ++i) {
      store(s.lo, s.dtype, at + i, r.lo[i]);
      store(s.hi, s.dtype, at + i, r.hi[i]);
      // lo and hi are stored values (exact in their dtype); c and r are rounded only once, here.
      const float lo = load(s.lo, s.dtype, at + i), hi = load(s.hi, s.dtype, at + i);
      c[i] = 0.5f * (lo + hi);
      radius[i] = 0.5f * (hi - lo);
    }
    if (s.rep_dtype == DType::U8) {
      quantize_bound(c, radius, d, static_cast<uint8_t*>(s.rep) + next, s.rep_scale[p * s.kv_heads + h]);
    } else {
      for (int64_t i = 0; i < d; ++i) {
        store(s.rep, s.rep_dtype, next + i, c[i]);
        store(s.rep, s.rep_dtype, next + d + i, radius[i]);
      }
    }
  }
}

// Fold one key (D floats) of head h into block p's summary, the key being the block's `offset`-th
// (offset 0 starts the block afresh), and derive the block's representation.
void fold(const Summaries& s, int64_t p, int64_t h, int64_t offset, const float* key) {
  if (s.mode == Mode::Hash) {
    hash_key(key, s.projection, s.head_dim, s.hash_bytes,
             s.hashes + ((p * s.block_size + offset) * s.kv_heads + h) * s.hash_bytes);
    return;
  }
  Running r;
  if (offset > 0) read_running(s, p, h, r);
  accumulate(r, s.mode, s.head_dim, offset, key);
  publish(s, p, h, r);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// The query group of one (request, KV head), ready for every way of scoring.
struct Group {
  int64_t g, d;
  const float* q;       // (G, D) float
  const float* q_abs;   // (G, D) |q|
  const uint16_t* qb;   // (G, D) bf16 of q (Bound/Mean fast path)
  const uint16_t* qab;  // (G, D) bf16 of |q|
  const int8_t* q8;       // (G, D) q quantized per head (U8 representations)
  const int8_t* q8_abs;   // (G, D) |q8|
  const float* q8_scale;  // (G,) q ~ q8_scale * q8
  const int32_t* q8_sum;  // (G,) sum of q8: the stored centres' offset of 128 adds 128 * q8_sum
};

// Each query head's row of q (G, D) as int8 with one scale (max |q| / 127) per head.
void quantize_query(const float* q, int64_t g, int64_t d, int8_t* q8, int8_t* q8_abs, float* scale, int32_t* sum) {
  for (int64_t j = 0; j < g; ++j) {
    float top = 0.0f;
    for (int64_t i = 0; i < d; ++i) top = std::max(top, std::fabs(q[j * d + i]));
    const float inv = top > 0.0f ? 127.0f / top : 0.0f;
    int32_t total = 0;
    for (int64_t i = 0; i < d; ++i) {
      const int8_t v = static_cast<int8_t>(std::clamp(std::nearbyint(q[j * d + i] * inv), -127.0f, 127.0f));
      q8[j * d + i] = v;
      q8_abs[j * d + i] = static_cast<int8_t>(v < 0 ? -v : v);
      total += v;
    }
    scale[j] = top / 127.0f;
    sum[j] = total;
  }
}

// A block's U8 bound for query head j from its integer dot product `dots` (sum over D of
// (c_q + 128) q8 + r_q |q8|), in the same operations on every path (so the same bits).
inline float quantized_logit(float dots, float block_scale, const Group& grp, int64_t j) {
  return (dots - 128.0f * static_cast<float>(grp.q8_sum[j])) * block_scale * grp.q8_scale[j];
}

#if defined(__AVX512F__)
// The lane sums of 16 vectors as the 16 lanes of one, in order: 45 shuffles and adds where 16
// separate reductions take ~130 (the scoring loop's largest cost once the dot products are bf16).
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] and v[2i+1], each folded to 2 partial sums
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the sums of v[4i..4i+3] over that lane
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // across 128-bit lanes: pairs of lanes added
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(__AVX512BF16__)
constexpr bool kFastBf16 = true;

inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

// sum over D (a multiple of 32) of a . b, both bf16.
inline __m512 dot_bf16(__m512 acc, const uint16_t* a, const uint16_t* b, int64_t d) {
  for (int64_t i = 0; i < d; i += 32) {
    const __m512i va = _mm512_loadu_si512(a + i), vb = _mm512_loadu_si512(b + i);
    acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(va), reinterpret_cast<__m512bh>(vb));
  }
  return acc;
}

// Representations (rep[i], each [mean? | c r?] per ``bound_at``) of 16 blocks scored against every
// query head of the group into 16 lanes of logits: for a head dim D known here, the 16 blocks'
// dot products unroll and run interleaved (with D a runtime value each one was a chain of
// dependent dpbf16s, waited on in turn: half of the selection's time).
template <int64_t D>
void score16(const uint16_t* const* rep, const Group& grp, bool has_mean, bool has_bound, int64_t bound_at,
             int64_t bound_row, int64_t n, float* logits) {
  __m512 acc[16];
  for (int64_t j = 0; j < grp.g; ++j) {
    __m512i q[D / 32], qa[D / 32];
    for (int64_t k = 0; k < D / 32; ++k) {
      q[k] = _mm512_loadu_si512(grp.qb + j * D + 32 * k);
      qa[k] = _mm512_loadu_si512(grp.qab + j * D + 32 * k);
    }
    auto dot = [](__m512 a, const uint16_t* x, const __m512i* y) {
      for (int64_t k = 0; k < D / 32; ++k)
        a = _mm512_dpbf16_ps(a, reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + 32 * k)),
                             reinterpret_cast<__m512bh>(y[k]));
      return a;
    };
    if (has_mean) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = dot(_mm512_setzero_ps(), rep[i], q);
      _mm512_storeu_ps(logits + j * n, reduce16(acc));
    }
    if (has_bound) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        acc[i] = dot(dot(_mm512_setzero_ps(), rep[i] + bound_at, q), rep[i] + bound_at + D, qa);
      _mm512_storeu_ps(logits + (bound_row + j) * n, reduce16(acc));
    }
  }
}
#else
constexpr bool kFastBf16 = false;
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// score16 for U8 representations ([c_q + 128 | r_q], D bytes each) with their 16 scales: both dot
// products of a block in one integer accumulator (u8 x s8, four products per lane and instruction),
// half the instructions and bytes of bf16.
template <int64_t D>
void score16_u8(const uint8_t* const* rep, __m512 scales, const Group& grp, int64_t n, float* logits) {
  __m512 acc[16];
  for (int64_t j = 0; j < grp.g; ++j) {
    __m512i q[D / 64], qa[D / 64];
    for (int64_t k = 0; k < D / 64; ++k) {
      q[k] = _mm512_loadu_si512(grp.q8 + j * D + 64 * k);
      qa[k] = _mm512_loadu_si512(grp.q8_abs + j * D + 64 * k);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      __m512i a = _mm512_setzero_si512();
      for (int64_t k = 0; k < D / 64; ++k) {
        a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(rep[i] + 64 * k), q[k]);
        a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(rep[i] + D + 64 * k), qa[k]);
      }
      acc[i] = _mm512_cvtepi32_ps(a);
    }
    // Whole numbers below 2^24 throughout: the float sums are exact, as the integer ones.
    const __m512 dots = _mm512_sub_ps(reduce16(acc), _mm512_set1_ps(128.0f * static_cast<float>(grp.q8_sum[j])));
    _mm512_storeu_ps(logits + j * n, _mm512_mul_ps(_mm512_mul_ps(dots, scales), _mm512_set1_ps(grp.q8_scale[j])));
  }
}
#endif

#if defined(__AVX2__)
// The lane sums of 8 vectors as the 8 lanes of one, in order (16 single-lane reductions, each a
// chain of dependent adds, were as costly as the dot products themselves).
inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// score16_u8 on AVX2: 8 blocks, their bytes widened to 16 bits and multiplied in pairs into 32-bit
// lanes (vpmaddwd): the same whole numbers as VNNI's (vpmaddubsw would saturate at 2^15).
template <int64_t D>
void score8_u8(const uint8_t* const* rep, __m256 scales, const Group& grp, int64_t n, float* logits) {
  __m256 acc[8];
  for (int64_t j = 0; j < grp.g; ++j) {
    __m256i q[D / 16], qa[D / 16];
    for (int64_t k = 0; k < D / 16; ++k) {
      q[k] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp.q8 + j * D + 16 * k)));
      qa[k] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp.q8_abs + j * D + 16 * k)));
    }
    auto widened = [](const uint8_t* p) {
      return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    };
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m256i a = _mm256_setzero_si256();
      for (int64_t k = 0; k < D / 16; ++k) {
        a = _mm256_add_epi32(a, _mm256_madd_epi16(widened(rep[i] + 16 * k), q[k]));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(widened(rep[i] + D + 16 * k), qa[k]));
      }
      acc[i] = _mm256_cvtepi32_ps(a);
    }
    const __m256 dots = _mm256_sub_ps(sum8(acc), _mm256_set1_ps(128.0f * static_cast<float>(grp.q8_sum[j])));
    _mm256_storeu_ps(logits + j * n, _mm256_mul_ps(_mm256_mul_ps(dots, scales), _mm256_set1_ps(grp.q8_scale[j])));
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
// 8 bf16 as floats (a bf16 is a float's upper half).
inline __m256 bf16x8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// AVX2's score16: 8 blocks' bf16 representations against every query head of the group (floats,
// rounded to bf16 already), into 8 lanes of logits.
template <int64_t D>
void score8(const uint16_t* const* rep, const Group& grp, bool has_mean, bool has_bound, int64_t bound_at,
            int64_t bound_row, int64_t n, float* logits) {
  __m256 acc[8];
  for (int64_t j = 0; j < grp.g; ++j) {
    const float* q = grp.q + j * D;
    const float* qa = grp.q_abs + j * D;
    if (has_mean) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t k = 0; k < D; k += 8) a = _mm256_fmadd_ps(bf16x8(rep[i] + k), _mm256_loadu_ps(q + k), a);
        acc[i] = a;
      }
      _mm256_storeu_ps(logits + j * n, sum8(acc));
    }
    if (has_bound) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const uint16_t* c = rep[i] + bound_at;
        __m256 a = _mm256_setzero_ps();
        for (int64_t k = 0; k < D; k += 8) {
          a = _mm256_fmadd_ps(bf16x8(c + k), _mm256_loadu_ps(q + k), a);
          a = _mm256_fmadd_ps(bf16x8(c + D + k), _mm256_loadu_ps(qa + k), a);
        }
        acc[i] = a;
      }
      _mm256_storeu_ps(logits + (bound_row + j) * n, sum8(acc));
    }
  }
}
#endif

// The representations of the blocks this many ahead of those being scored are asked for while
// these are: a request's blocks lie wherever the engine put them, too scattered for the hardware
// prefetcher (8 requests of their own 32k-token documents, summaries cold: 0.77 ms per layer
// without, 0.45 with, about what one pass of index_select over the same bytes takes).
constexpr int64_t kPrefetchAhead = 48;

// Prefetch the representations (`bytes` each) of head h of blocks table[from..to), and their scales
// when quantized, into L2: asked into L1 (16 blocks ahead), they gained nothing.
inline void prefetch_reps(const void* base, const float* scales, const int32_t* table, int64_t from, int64_t to,
                          int64_t hkv, int64_t h, int64_t bytes) {
  for (int64_t i = from; i < to; ++i) {
    const int64_t row = static_cast<int64_t>(table[i]) * hkv + h;
    const char* at = static_cast<const char*>(base) + row * bytes;
    for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(at + byte, 0, 2);
    if (scales) __builtin_prefetch(scales + row, 0, 2);
  }
}

// The SIMD paths' walk over a request's blocks, W at a time: each group's representations (`elems`
// of T per block head) handed to score(rep, first block), the blocks kPrefetchAhead on asked for
// meanwhile. Returns the first block left for the scalar tail.
template <int W, typename T, typename Score>
int64_t score_in_groups(const void* reps, const float* scales, const int32_t* table, int64_t n, int64_t hkv,
                        int64_t h, int64_t elems, Score score) {
  const T* base = static_cast<const T*>(reps);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(T));
  prefetch_reps(base, scales, table, 0, std::min(kPrefetchAhead, n), hkv, h, bytes);
  int64_t blk = 0;
  for (; blk + W <= n; blk += W) {
    const T* rep[W];
    for (int i = 0; i < W; ++i) rep[i] = base + (static_cast<int64_t>(table[blk + i]) * hkv + h) * elems;
    prefetch_reps(base, scales, table, blk + kPrefetchAhead, std::min(blk + kPrefetchAhead + W, n), hkv, h, bytes);
    score(rep, blk);
  }
  return blk;
}

// score(std::integral_constant<int64_t, D>{}) for the head dims the SIMD paths unroll for (64 or
// 128, checked by their callers): one dispatch from a runtime D to the templates.
template <typename Score>
void by_head_dim(int64_t d, Score score) {
  if (d == 64)
    score(std::integral_constant<int64_t, 64>{});
  else
    score(std::integral_constant<int64_t, 128>{});
}

// logits[j * n + blk] for every query head j and block of the request: an estimate of the largest
// logit (before the temperature) a key of the block gives that head. Both: rows 0..G-1 from the
// mean key, rows G..2G-1 from the bound.
void score_blocks(const Summaries& s, const Group& grp, const int32_t* table, int64_t n, int64_t seq, int64_t h,
                  const int32_t* channels, int64_t used, const uint8_t* qhash, float* logits) {
  const int64_t hkv = s.kv_heads, d = s.head_dim, g = grp.g, b = s.block_size, width = rep_width(s.mode);
  [[maybe_unused]] const bool fast = kFastBf16 && s.rep_dtype == DType::BF16 && d % 32 == 0 && used == d;
  const bool has_mean = s.mode == Mode::Mean || s.mode == Mode::Both;
  const bool has_bound = s.mode == Mode::Bound || s.mode == Mode::Both;
  const int64_t bound_row = s.mode == Mode::Both ? g : 0;  // first logits row of the bound
  const int64_t bound_at = s.mode == Mode::Both ? d : 0;   // the bound's [c | r] within rep
  float row[3 * 512];
  int64_t blk = 0;
#if defined(__AVX512BF16__)
  if (fast && s.mode != Mode::Hash && (d == 64 || d == 128)) {
    blk = score_in_groups<16, uint16_t>(s.rep, nullptr, table, n, hkv, h, d * width,
                                        [&](const uint16_t* const* rep, int64_t first) {
                                          by_head_dim(d, [&](auto dim) {
                                            score16<dim>(rep, grp, has_mean, has_bound, bound_at, bound_row, n,
                                                         logits + first);
                                          });
                                        });
  }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (s.rep_dtype == DType::U8 && (d == 64 || d == 128)) {
    const __m512i vhkv = _mm512_set1_epi32(static_cast<int32_t>(hkv));
    const __m512i vh = _mm512_set1_epi32(static_cast<int32_t>(h));
    blk = score_in_groups<16, uint8_t>(s.rep, s.rep_scale, table, n, hkv, h, 2 * d,
                                       [&](const uint8_t* const* rep, int64_t first) {
                                         const __m512i ids = _mm512_loadu_si512(table + first);
                                         const __m512 scales = _mm512_i32gather_ps(
                                             _mm512_add_epi32(_mm512_mullo_epi32(ids, vhkv), vh), s.rep_scale, 4);
                                         by_head_dim(d, [&](auto dim) {
                                           score16_u8<dim>(rep, scales, grp, n, logits + first);
                                         });
                                       });
  }
#endif
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
  if (s.rep_dtype == DType::U8 && (d == 64 || d == 128)) {
    const __m256i vhkv = _mm256_set1_epi32(static_cast<int32_t>(hkv));
    const __m256i vh = _mm256_set1_epi32(static_cast<int32_t>(h));
    blk = score_in_groups<8, uint8_t>(s.rep, s.rep_scale, table, n, hkv, h, 2 * d,
                                      [&](const uint8_t* const* rep, int64_t first) {
                                        const __m256i ids =
                                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table + first));
                                        const __m256 scales = _mm256_i32gather_ps(
                                            s.rep_scale, _mm256_add_epi32(_mm256_mullo_epi32(ids, vhkv), vh), 4);
                                        by_head_dim(d, [&](auto dim) {
                                          score8_u8<dim>(rep, scales, grp, n, logits + first);
                                        });
                                      });
  }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
  if (s.rep_dtype == DType::BF16 && used == d && s.mode != Mode::Hash && (d == 64 || d == 128)) {
    blk = score_in_groups<8, uint16_t>(s.rep, nullptr, table, n, hkv, h, d * width,
                                       [&](const uint16_t* const* rep, int64_t first) {
                                         by_head_dim(d, [&](auto dim) {
                                           score8<dim>(rep, grp, has_mean, has_bound, bound_at, bound_row, n,
                                                       logits + first);
                                         });
                                       });
  }
#endif
  for (; blk < n; ++blk) {
    const int64_t p = table[blk];
    if (s.mode == Mode::Hash) {
      const int64_t filled = blk == n - 1 ? seq - (n - 1) * b : b;
      for (int64_t j = 0; j < g; ++j) {
        int nearest = std::numeric_limits<int>::max();
        for (int64_t t = 0; t < filled; ++t) {
          const uint8_t* key = s.hashes + ((p * b + t) * hkv + h) * s.hash_bytes;
          nearest = std::min(nearest, popcount_xor(qhash + j * s.hash_bytes, key, s.hash_bytes));
        }
        logits[j * n + blk] = -static_cast<float>(nearest);
      }
      continue;
    }
    const int64_t at = (p * hkv + h) * d * width;
    if (s.rep_dtype == DType::U8) {
      const uint8_t* rep = static_cast<const uint8_t*>(s.rep) + at;
      const float scale = s.rep_scale[p * hkv + h];
      for (int64_t j = 0; j < g; ++j) {
        const int8_t *qj = grp.q8 + j * d, *qa = grp.q8_abs + j * d;
        int32_t dots = 0;
#pragma omp simd reduction(+ : dots)
        for (int64_t i = 0; i < d; ++i) dots += rep[i] * qj[i] + rep[d + i] * qa[i];
        logits[j * n + blk] = quantized_logit(static_cast<float>(dots), scale, grp, j);
      }
      continue;
    }
#if defined(__AVX512BF16__)
    if (fast) {
      const uint16_t* rep = static_cast<const uint16_t*>(s.rep) + at;
      for (int64_t j = 0; j < g; ++j) {
        if (has_mean) logits[j * n + blk] = reduce(dot_bf16(_mm512_setzero_ps(), rep, grp.qb + j * d, d));
        if (has_bound) {
          __m512 acc = dot_bf16(_mm512_setzero_ps(), rep + bound_at, grp.qb + j * d, d);
          acc = dot_bf16(acc, rep + bound_at + d, grp.qab + j * d, d);
          logits[(bound_row + j) * n + blk] = reduce(acc);
        }
      }
      continue;
    }
#endif
    load_row(s.rep, s.rep_dtype, at, width * d, row);
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = grp.q + j * d;
      if (has_mean && used == d) {
        logits[j * n + blk] = dot(qj, row, d);
      } else if (has_mean) {
        float acc = 0.0f;
        for (int64_t c = 0; c < used; ++c) acc += qj[channels[c]] * row[channels[c]];
        logits[j * n + blk] = acc;
      }
      if (has_bound)
        logits[(bound_row + j) * n + blk] =
            dot(qj, row + bound_at, d) + dot(grp.q_abs + j * d, row + bound_at + d, d);
    }
  }
}

}  // namespace

void write(const Summaries& s, const void* keys, DType key_dtype, int64_t token_stride, const int64_t* slots,
           int64_t tokens) {
  check(s);
  const int64_t hkv = s.kv_heads, d = s.head_dim, b = s.block_size;
  // One thread per KV head: a block's tokens arrive in order and each head's summary is its own.
#pragma omp parallel for schedule(static) if (tokens * hkv > 64)
  for (int64_t h = 0; h < hkv; ++h) {
    float key[512];
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      load_row(keys, key_dtype, t * token_stride + h * d, d, key);
      fold(s, slot / b, h, slot % b, key);
    }
  }
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) s.count[slots[t] / b] = static_cast<int32_t>(slots[t] % b + 1);
}

void refresh(const Summaries& s, const void* key_cache, DType cache_dtype, int64_t block_stride,
             int64_t head_stride, const int32_t* positions, const int32_t* blocks, const int32_t* fill, int64_t n) {
  check(s);
  const int64_t hkv = s.kv_heads, d = s.head_dim;
#pragma omp parallel for schedule(dynamic) if (n > 1)
  for (int64_t i = 0; i < n; ++i) {
    float key[512];
    Running r;
    const int64_t p = blocks[i];
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t base = p * block_stride + h * head_stride;
      for (int64_t t = 0; t < fill[i]; ++t) {
        gather_row(key_cache, cache_dtype, base, positions + t * d, d, key);
        if (s.mode == Mode::Hash)
          fold(s, p, h, t, key);
        else
          accumulate(r, s.mode, d, t, key);
      }
      // The block's summary is stored and its representation derived once, not once per token.
      if (s.mode != Mode::Hash && fill[i] > 0) publish(s, p, h, r);
    }
    s.count[p] = fill[i];
  }
}

void select(const Summaries& s, const Selection& sel) {
  check(s);
  const int64_t hkv = s.kv_heads, d = s.head_dim, b = s.block_size;
  if (sel.heads % hkv) throw std::invalid_argument("query heads must be a multiple of KV heads");
  const int64_t g = sel.heads / hkv;
  if (g > 64) throw std::invalid_argument("at most 64 query heads per KV head");
  const int64_t pairs = sel.rows * hkv;
#pragma omp parallel
  {
    std::vector<float> logits, group;
    std::vector<uint32_t> keys;
    std::vector<uint8_t> flags;
    std::vector<uint64_t> ranked;
    std::vector<float> q(g * d), q_abs(g * d);
    std::vector<uint16_t> qb(g * d), qab(g * d);
    std::vector<int8_t> q8(g * d), q8_abs(g * d);
    std::vector<float> q8_scale(g);
    std::vector<int32_t> q8_sum(g);
    float channel_weight[512];
    int32_t channels[512];
    uint8_t qhash[64 * 64];
#pragma omp for schedule(dynamic)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t r = pair / hkv, h = pair % hkv;
      const int64_t seq = sel.seq_lens[r], n = (seq + b - 1) / b, k = std::min<int64_t>(sel.budget[r], n);
      const int32_t* table = sel.block_table + r * sel.table_stride;
      int32_t* out = sel.out + pair * sel.out_stride;
      for (int64_t j = 0; j < g; ++j)
        load_row(sel.query, sel.query_dtype, sel.tokens[r] * sel.token_stride + (h * g + j) * d, d, &q[j * d]);
      // Scored against bf16 representations, the query is rounded to bf16 too, on every path (the
      // dot products then differ between machines only in summation order).
      const bool round = s.rep_dtype == DType::BF16 && s.mode != Mode::Hash;
      for (int64_t i = 0; i < g * d; ++i) {
        qb[i] = float_to_bf16(q[i]);
        if (round) q[i] = bf16_to_float(qb[i]);
        q_abs[i] = std::fabs(q[i]);
        qab[i] = float_to_bf16(q_abs[i]);
      }
      // Mean: the channels scored (all, or those where the group's |q| is largest).
      int64_t used = d;
      for (int64_t c = 0; c < d; ++c) channels[c] = static_cast<int32_t>(c);
      if (s.mode == Mode::Mean && sel.keep_channels > 0 && sel.keep_channels < d) {
        for (int64_t c = 0; c < d; ++c) {
          channel_weight[c] = 0.0f;
          for (int64_t j = 0; j < g; ++j) channel_weight[c] += q_abs[j * d + c];
        }
        used = sel.keep_channels;
        std::nth_element(channels, channels + used - 1, channels + d, [&](int32_t x, int32_t y) {
          return channel_weight[x] > channel_weight[y] || (channel_weight[x] == channel_weight[y] && x < y);
        });
        std::sort(channels, channels + used);
      }
      if (s.rep_dtype == DType::U8)
        quantize_query(q.data(), g, d, q8.data(), q8_abs.data(), q8_scale.data(), q8_sum.data());
      if (s.mode == Mode::Hash)
        for (int64_t j = 0; j < g; ++j) hash_key(&q[j * d], s.projection, d, s.hash_bytes, qhash + j * s.hash_bytes);
      const int64_t estimates = s.mode == Mode::Both ? 2 : 1;
      logits.resize(estimates * g * n);
      const Group grp{g,         d,         q.data(),        q_abs.data(), qb.data(), qab.data(),
                      q8.data(), q8_abs.data(), q8_scale.data(), q8_sum.data()};
      score_blocks(s, grp, table, n, seq, h, channels, used, qhash, logits.data());
      // Per query head (and estimate), a softmax over blocks (each head's share of the group's
      // attention), summed over the group: a head whose logits are larger does not outvote the
      // others. Two estimates are averaged.
      group.assign(n, 0.0f);
      for (int64_t j = 0; j < estimates * g; ++j) {
        float* head = logits.data() + j * n;
        const float total = softmax_terms(head, n, sel.temperature);
        const float inv = 1.0f / (total * static_cast<float>(estimates));
#pragma omp simd
        for (int64_t blk = 0; blk < n; ++blk) group[blk] += head[blk] * inv;
      }
      if (sel.prior)
        for (int64_t blk = 0; blk < n; ++blk) group[blk] += sel.prior[static_cast<int64_t>(table[blk]) * hkv + h];
      if (sel.scores) std::memcpy(sel.scores + pair * sel.score_stride, group.data(), n * sizeof(float));
      int64_t keep = k;
      if (sel.mass > 0.0f) {  // the fewest blocks, best first (the windows first), holding `mass`
        // Sorted as one integer per block, the score's order key (complemented: best first; the
        // windows rank as +inf) above the block index (ties in block order): a comparison per pair
        // of integers, where comparing floats through a ranking closure took most of PSA's selection.
        ranked.resize(n);
        for (int64_t blk = 0; blk < n; ++blk) {
          const bool window = blk < sel.init || blk >= n - sel.local;
          const uint64_t score = ~order_key(window ? kInf : group[blk]);
          ranked[blk] = score << 32 | static_cast<uint64_t>(blk);
        }
        // Ranked lazily: only the best `sorted` are in order, the rest all worse; the walk below
        // sorts the next stretch when it gets there (it usually stops near half the blocks, and
        // sums the same blocks in the same order as a full sort would).
        int64_t sorted = 0;
        const auto rank_up_to = [&](int64_t upto) {
          upto = std::min(upto, n);
          if (upto < n) std::nth_element(ranked.begin() + sorted, ranked.begin() + upto, ranked.end());
          std::sort(ranked.begin() + sorted, ranked.begin() + upto);
          sorted = upto;
        };
        const uint64_t first_scored = static_cast<uint64_t>(~order_key(kInf)) << 32 | 0xFFFFFFFFu;
        const float target = sel.mass * static_cast<float>(g);  // each query head's softmax sums to 1
        float reached = 0.0f;
        int64_t taken = 0;
        flags.assign(n, 0);
        for (; taken < keep; ++taken) {
          if (taken == sorted) rank_up_to(std::max<int64_t>({2 * sorted, sel.init + sel.local + n / 4, 1}));
          const int32_t blk = static_cast<int32_t>(ranked[taken] & 0xFFFFFFFFu);
          if (ranked[taken] > first_scored && reached >= target) break;  // past the windows, enough
          reached += group[blk];
          flags[blk] = 1;
        }
        if (taken == 0) {  // a zero budget: the best block
          rank_up_to(1);
          flags[ranked[0] & 0xFFFFFFFFu] = 1;
        }
        keep = 0;  // ascending, so the block being written is last
        for (int64_t blk = 0; blk < n; ++blk)
          if (flags[blk]) out[keep++] = table[blk] * static_cast<int32_t>(hkv) + h;
      } else {
        // The windows, then the best of the rest: the k-th largest score is the threshold; blocks
        // above it are kept, then ties in block order. Ascending, so the block being written is last.
        for (int64_t blk = 0; blk < std::min<int64_t>(sel.init, n); ++blk) group[blk] = kInf;
        for (int64_t blk = std::max<int64_t>(0, n - sel.local); blk < n; ++blk) group[blk] = kInf;
        keys.resize(n);
        for (int64_t blk = 0; blk < n; ++blk) keys[blk] = order_key(group[blk]);
        const uint32_t cut = keep < n ? kth_largest(keys.data(), n, keep) : 0;
        int64_t above = 0;
#pragma omp simd reduction(+ : above)
        for (int64_t blk = 0; blk < n; ++blk) above += keys[blk] > cut;
        take_blocks(keys.data(), table, n, cut, keep - above, static_cast<int32_t>(hkv), static_cast<int32_t>(h), out);
      }
      if (sel.kept) sel.kept[pair] = static_cast<int32_t>(keep);
    }
  }
}

int64_t fetch(const Fetch& f) {
  int64_t copied = 0;
  bool short_of_slots = false;
#pragma omp parallel for schedule(dynamic) reduction(+ : copied) reduction(|| : short_of_slots) if (f.rows > 1)
  for (int64_t row = 0; row < f.rows; ++row) {
    int32_t* table = f.table + row * f.table_stride;
    const int64_t* slots = f.slots + (row / f.kv_heads) * f.slot_stride;
    const int64_t head = row % f.kv_heads;
    std::vector<char> taken(static_cast<size_t>(f.slot_stride), 0);
    auto plane_of = [&](int64_t j) { return slots[j] * f.kv_heads + head; };
    // Hits first, so that a miss never takes the slot of a block kept this step.
    for (int64_t c = 0; c < f.width; ++c) {
      if (table[c] < f.resident_planes) continue;
      const int64_t a = table[c] - f.resident_planes;
      const int32_t j = f.slot_of[a];
      if (j >= 0 && j < f.slot_stride && slots[j] >= 0 && f.holds[plane_of(j)] == a) {
        taken[j] = 1;
        table[c] = static_cast<int32_t>(plane_of(j));
      }
    }
    int64_t next = 0;
    for (int64_t c = 0; c < f.width; ++c) {
      if (table[c] < f.resident_planes) continue;
      const int64_t a = table[c] - f.resident_planes;
      while (next < f.slot_stride && (taken[next] || slots[next] < 0)) ++next;
      if (next == f.slot_stride) {
        short_of_slots = true;
        break;
      }
      const int64_t p = plane_of(next);
      const int32_t before = f.holds[p];
      if (before >= 0 && f.slot_of[before] == next) f.slot_of[before] = -1;
      std::memcpy(f.planes + p * f.plane_bytes, f.arena + a * f.plane_bytes, static_cast<size_t>(f.plane_bytes));
      f.holds[p] = static_cast<int32_t>(a);
      f.slot_of[a] = static_cast<int32_t>(next);
      taken[next] = 1;
      table[c] = static_cast<int32_t>(p);
      ++copied;
    }
  }
  return short_of_slots ? -1 : copied;
}

}  // namespace ucm::sparse
