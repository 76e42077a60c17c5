// Fused Adam/AdamW step for CPU tensors, with the updated parameter optionally written to a second buffer
// as bf16/fp16/fp32 in the same pass (the buffer that is copied back to the GPU).
//
// The library exports a plain C ABI (called through ctypes) instead of a pybind11/torch extension: it needs
// no torch headers, so it compiles in about a second and cannot break when torch's C++ ABI changes.
//
// [Note: one rounding order everywhere]
// The vector bodies (AVX-512, AVX2) and the scalar body compute exactly the same sequence of IEEE operations
// (FMAs only where written explicitly; the file is built with -ffp-contract=off), so a result never depends on
// which elements landed in a vector body or in a tail, i.e. on the thread count or on the ISA of the machine.
//
//   g  = grad / grad_scale                    (a loss scale, or 1)
//   Adam:  g = fma(p, weight_decay, g)          AdamW: p = p * (1 - lr * weight_decay)
//   m  = lerp(m, g, 1 - beta1)                = fma(1 - beta1, g - m, m)   (or fma(-beta1, g - m, g))
//   v  = fma((1 - beta2) * g, g, v * beta2)
//   p  = p - (step_size * m) / (sqrt(v) / bc2_sqrt + eps)
// This follows torch's fused CPU Adam (its lerp, and the FMAs its vector code compiles to), and every
// coefficient (1 - beta1, 1 - lr * weight_decay, ...) is computed by the caller in double and rounded once to
// float as torch does, so results track torch's to within a few ulp.
//
// bf16 output rounds to nearest even (NaN becomes 0x7FC0), like torch's `.to(torch.bfloat16)`; fp16 output
// uses the hardware conversion (F16C) in round-to-nearest-even mode, like torch's `.to(torch.float16)`.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

enum DType : int { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };

struct Hyper {
  float beta1, beta2, eps, weight_decay;
  float one_minus_beta1, one_minus_beta2, decay;  // decay = 1 - lr * weight_decay (AdamW)
  float step_size, bc2_sqrt, grad_scale;
  bool adamw;
  bool lerp_low;  // 1 - beta1 < 0.5: which of torch's two lerp formulas applies
};

// ---------------------------------------------------------------- scalar conversions
inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u = float_to_bits(f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
// IEEE half <-> float without hardware support (only used when F16C is absent).
inline float f16_to_float_sw(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal half: normalise
      int e = -1;
      do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | ((man & 0x3FFu) << 13);
    }
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  return bits_to_float(u);
}
inline uint16_t float_to_f16_sw(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // rounds to inf
  if (a < 0x38800000u) {                        // subnormal or zero half
    float r = bits_to_float(a) + 0.5f;          // the add rounds to nearest even at 2^-24
    return sign | static_cast<uint16_t>(float_to_bits(r) - 0x3F000000u);
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xC8000FFFu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return sign | static_cast<uint16_t>(a >> 13);
}
inline float f16_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return f16_to_float_sw(h);
#endif
}
inline uint16_t float_to_f16(float f) {
#ifdef __F16C__
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  return float_to_f16_sw(f);
#endif
}

template <int G>
inline float load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) return static_cast<const float*>(g)[i];
  if constexpr (G == kBF16) return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
  return f16_to_float(static_cast<const uint16_t*>(g)[i]);
}
template <int O>
inline void store_out(void* o, int64_t i, float x) {
  if constexpr (O == kF32) static_cast<float*>(o)[i] = x;
  if constexpr (O == kBF16) static_cast<uint16_t*>(o)[i] = float_to_bf16(x);
  if constexpr (O == kF16) static_cast<uint16_t*>(o)[i] = float_to_f16(x);
}

template <int G, int O>
void adam_scalar(float* p, const void* g, float* m, float* v, void* o, int64_t begin, int64_t end, const Hyper& h) {
  for (int64_t i = begin; i < end; ++i) {
    float gi = load_grad<G>(g, i) / h.grad_scale;
    float pi = p[i];
    if (h.adamw) {
      pi = pi * h.decay;
    } else {
      gi = std::fma(pi, h.weight_decay, gi);
    }
    const float mi = h.lerp_low ? std::fma(h.one_minus_beta1, gi - m[i], m[i])
                                : std::fma(-h.beta1, gi - m[i], gi);
    const float vi = std::fma(h.one_minus_beta2 * gi, gi, v[i] * h.beta2);
    float denom = std::sqrt(vi) / h.bc2_sqrt + h.eps;
    pi = pi - (h.step_size * mi) / denom;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    store_out<O>(o, i, pi);
  }
}

// ---------------------------------------------------------------- vector bodies
#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
using VF = __m512;
inline VF vset(float x) { return _mm512_set1_ps(x); }
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vdiv(VF a, VF b) { return _mm512_div_ps(a, b); }
inline VF vsqrt(VF a) { return _mm512_sqrt_ps(a); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
template <int G>
inline VF vload_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
  if constexpr (G == kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}
template <int O, bool kStream>
inline void vstore_out(void* o, int64_t i, VF x) {
  if constexpr (O == kF32) {
    if constexpr (kStream) _mm512_stream_ps(static_cast<float*>(o) + i, x);
    else _mm512_storeu_ps(static_cast<float*>(o) + i, x);
  }
  if constexpr (O == kBF16 || O == kF16) {
    __m256i h;
    if constexpr (O == kBF16) {
      const __m512i u = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
      h = _mm512_cvtepi32_epi16(r);
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o) + i);
    if constexpr (kStream) _mm256_stream_si256(dst, h);
    else _mm256_storeu_si256(dst, h);
  }
}
#define CAI_HAVE_VECTOR 1
const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr int64_t kWidth = 8;
using VF = __m256;
inline VF vset(float x) { return _mm256_set1_ps(x); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vdiv(VF a, VF b) { return _mm256_div_ps(a, b); }
inline VF vsqrt(VF a) { return _mm256_sqrt_ps(a); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
template <int G>
inline VF vload_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
  if constexpr (G == kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}
template <int O, bool kStream>
inline void vstore_out(void* o, int64_t i, VF x) {
  if constexpr (O == kF32) {
    if constexpr (kStream) _mm256_stream_ps(static_cast<float*>(o) + i, x);
    else _mm256_storeu_ps(static_cast<float*>(o) + i, x);
  }
  if constexpr (O == kBF16 || O == kF16) {
    __m128i h;
    if constexpr (O == kBF16) {
      const __m256i u = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
      // values are < 2^16, so unsigned-saturating packs are exact; the pack interleaves 128-bit lanes.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
      h = _mm256_castsi256_si128(packed);
    } else {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(o) + i);
    if constexpr (kStream) _mm_stream_si128(dst, h);
    else _mm_storeu_si128(dst, h);
  }
}
#define CAI_HAVE_VECTOR 1
const char* kIsa = "avx2";
#else
const char* kIsa = "scalar";
#endif

template <int G, int O, bool kStream>
int64_t adam_vector(float* p, const void* g, float* m, float* v, void* o, int64_t i, int64_t end, const Hyper& h) {
#ifdef CAI_HAVE_VECTOR
  const VF beta2 = vset(h.beta2), omb1 = vset(h.one_minus_beta1), omb2 = vset(h.one_minus_beta2),
           neg_beta1 = vset(-h.beta1), eps = vset(h.eps), wd = vset(h.weight_decay), decay = vset(h.decay),
           step_size = vset(h.step_size), bc2_sqrt = vset(h.bc2_sqrt), grad_scale = vset(h.grad_scale);
  for (; i + kWidth <= end; i += kWidth) {
    VF gi = vdiv(vload_grad<G>(g, i), grad_scale);
#if defined(__AVX512F__)
    VF pi = _mm512_loadu_ps(p + i), mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i);
#else
    VF pi = _mm256_loadu_ps(p + i), mi = _mm256_loadu_ps(m + i), vi = _mm256_loadu_ps(v + i);
#endif
    if (h.adamw) {
      pi = vmul(pi, decay);
    } else {
      gi = vfma(pi, wd, gi);
    }
    mi = h.lerp_low ? vfma(omb1, vsub(gi, mi), mi) : vfma(neg_beta1, vsub(gi, mi), gi);
    vi = vfma(vmul(omb2, gi), gi, vmul(vi, beta2));
    const VF denom = vadd(vdiv(vsqrt(vi), bc2_sqrt), eps);
    pi = vsub(pi, vdiv(vmul(step_size, mi), denom));
#if defined(__AVX512F__)
    _mm512_storeu_ps(p + i, pi), _mm512_storeu_ps(m + i, mi), _mm512_storeu_ps(v + i, vi);
#else
    _mm256_storeu_ps(p + i, pi), _mm256_storeu_ps(m + i, mi), _mm256_storeu_ps(v + i, vi);
#endif
    vstore_out<O, kStream>(o, i, pi);
  }
#endif
  return i;
}

// Ranges at least this long write the copy-out buffer with non-temporal stores: the CPU never reads it again
// (it goes to the GPU), so skipping the read-for-ownership halves that buffer's traffic and keeps the cache
// for param/exp_avg/exp_avg_sq. Shorter ranges may still be in cache when the copy reads them.
constexpr int64_t kStreamMin = 1 << 16;

template <int G, int O>
void adam_range(float* p, const void* g, float* m, float* v, void* o, int64_t begin, int64_t end, const Hyper& h) {
  int64_t i = begin;
#ifdef CAI_HAVE_VECTOR
  if constexpr (O != kNone) {
    constexpr int64_t kBytes = O == kF32 ? 4 : 2;
    constexpr uintptr_t kVecBytes = kWidth * kBytes;  // a streaming store needs this alignment
    const uintptr_t addr = reinterpret_cast<uintptr_t>(static_cast<char*>(o) + begin * kBytes);
    if (end - begin >= kStreamMin && addr % kBytes == 0) {
      const int64_t head = static_cast<int64_t>(((kVecBytes - addr % kVecBytes) % kVecBytes) / kBytes);
      adam_scalar<G, O>(p, g, m, v, o, begin, begin + head, h);
      i = adam_vector<G, O, true>(p, g, m, v, o, begin + head, end, h);
      _mm_sfence();  // order the streaming stores before the caller (or a copy engine) reads the buffer
      adam_scalar<G, O>(p, g, m, v, o, i, end, h);
      return;
    }
  }
  i = adam_vector<G, O, false>(p, g, m, v, o, begin, end, h);
#endif
  adam_scalar<G, O>(p, g, m, v, o, i, end, h);
}

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;
// Threads split the tensor into contiguous ranges whose lengths are multiples of 16 elements (a 64-byte line of
// fp32), so neighbouring threads share no cache line when the tensors are line-aligned (torch's are).
constexpr int64_t kAlign = 16;

template <int G, int O>
void adam_parallel(float* p, const void* g, float* m, float* v, void* o, int64_t n, const Hyper& h, int threads) {
  int64_t want = n / kMinPerThread;
  if (want < 1) want = 1;
  if (threads > want) threads = static_cast<int>(want);
  if (threads <= 1) {
    adam_range<G, O>(p, g, m, v, o, 0, n, h);
    return;
  }
  int64_t per = (n + threads - 1) / threads;
  per = (per + kAlign - 1) / kAlign * kAlign;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = t * per;
    const int64_t end = begin + per < n ? begin + per : n;
    if (begin < end) adam_range<G, O>(p, g, m, v, o, begin, end, h);
  }
}

template <int G>
int dispatch_out(float* p, const void* g, float* m, float* v, void* o, int out_dtype, int64_t n, const Hyper& h,
                 int threads) {
  switch (out_dtype) {
    case kNone: adam_parallel<G, kNone>(p, g, m, v, o, n, h, threads); return 0;
    case kF32: adam_parallel<G, kF32>(p, g, m, v, o, n, h, threads); return 0;
    case kBF16: adam_parallel<G, kBF16>(p, g, m, v, o, n, h, threads); return 0;
    case kF16: adam_parallel<G, kF16>(p, g, m, v, o, n, h, threads); return 0;
    default: return 2;
  }
}

}  // namespace

extern "C" {

// Which vector body this build uses: "avx512", "avx2" or "scalar".
const char* cai_cpu_adam_isa() { return kIsa; }

// One Adam/AdamW step over n contiguous elements. grad_dtype/out_dtype: 0 fp32, 1 bf16, 2 fp16, -1 no out.
// The caller computes, in double and rounded once to float: one_minus_beta1/2 = 1 - beta1/2,
// decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t) (t 1-based).
// Returns 0 on success, 1 for a bad grad dtype, 2 for a bad out dtype.
int cai_cpu_adam_step(float* param, const void* grad, int grad_dtype, float* exp_avg, float* exp_avg_sq,
                      void* out, int out_dtype, int64_t n, float beta1, float beta2, float one_minus_beta1,
                      float one_minus_beta2, float eps, float weight_decay, float decay, int adamw,
                      float step_size, float bc2_sqrt, float grad_scale, int num_threads) {
  Hyper h;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.one_minus_beta1 = one_minus_beta1;
  h.one_minus_beta2 = one_minus_beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.decay = decay;
  h.step_size = step_size;
  h.bc2_sqrt = bc2_sqrt;
  h.grad_scale = grad_scale;
  h.adamw = adamw != 0;
  h.lerp_low = one_minus_beta1 < 0.5f;
  if (num_threads < 1) num_threads = 1;
  switch (grad_dtype) {
    case kF32: return dispatch_out<kF32>(param, grad, exp_avg, exp_avg_sq, out, out_dtype, n, h, num_threads);
    case kBF16: return dispatch_out<kBF16>(param, grad, exp_avg, exp_avg_sq, out, out_dtype, n, h, num_threads);
    case kF16: return dispatch_out<kF16>(param, grad, exp_avg, exp_avg_sq, out, out_dtype, n, h, num_threads);
    default: return 1;
  }
}

}  // extern "C"
