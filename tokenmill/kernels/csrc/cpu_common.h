// What tokenmill's CPU kernels share: the ISA level picked at run time, bf16 <-> float, the
// GCC target attributes each level compiles under, AMX permission, a vectorizable exp.
#pragma once

// Light headers (the tensor type, the thread count, the few ops used): ATen/ATen.h costs ~7 s
// of compilation per file.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace tokenmill {

using bf16 = c10::BFloat16;

// ISA levels: 0 portable C++, 1 AVX2 + FMA + F16C, 2 AVX-512 (F, BW, VL, DQ), 3 AVX-512 with BF16
// dot products (vdpbf16ps) and VNNI (vpdpbusd: every CPU with the one has the other), 4 AMX-BF16
// tiles (with level 3 for what tiles do not cover).
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

int detect_isa();
int current_isa();
int set_isa(int level);  // clamped to [0, detect_isa()]

#define TM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define TM_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c")))
#define TM_AMX                                                                               \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16," \
                        "avx512vnni,fma,f16c")))

inline float bf16_bits_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

// Round to nearest even, NaN to a quiet NaN (as c10::BFloat16), without branches so that loops
// of stores vectorize.
inline uint16_t float_to_bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

inline float load_float(const float* p) { return *p; }
// Through uint16_t, not the struct's member: GCC vectorizes loops of these only so.
inline float load_float(const bf16* p) {
  return bf16_bits_to_float(*reinterpret_cast<const uint16_t*>(p));
}
inline void store_float(float* p, float v) { *p = v; }
inline void store_float(bf16* p, float v) {
  *reinterpret_cast<uint16_t*>(p) = float_to_bf16_bits(v);
}

// exp(x), Cephes' polynomial (~1 ulp; x clamped to [-87, 88], so exp of very negative x is
// ~1e-38, not 0), written without branches so that loops around it vectorize.
__attribute__((always_inline)) inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // n = x / ln 2 rounded to nearest (adding and taking 1.5 * 2^23: floorf does not vectorize).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n in two halves: n reaches 128 at the top of the range.
  const int32_t half = static_cast<int32_t>(n) / 2;
  const int32_t bits_a = (half + 127) << 23, bits_b = (static_cast<int32_t>(n) - half + 127) << 23;
  float scale_a, scale_b;
  std::memcpy(&scale_a, &bits_a, sizeof(float));
  std::memcpy(&scale_b, &bits_b, sizeof(float));
  return p * scale_a * scale_b;
}

// Threads a fused call runs on: torch's intra-op thread count, or 1 inside another parallel
// region.
inline int team_size() { return omp_in_parallel() ? 1 : at::get_num_threads(); }

// Whether this process may use AMX tiles (asks Linux once; false where it refuses).
bool amx_permitted();

}  // namespace tokenmill
