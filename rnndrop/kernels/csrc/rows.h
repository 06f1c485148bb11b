// The pointwise math of one row of one step (H elements), as small functions with
// unaliased pointers that the compiler vectorises (the build passes -fno-trapping-math, so
// that the clamps below become vector min / max). On x86-64 with GCC each is also compiled
// for AVX-512 and AVX2 and the copy is picked at load time (target_clones), so the build
// does not depend on the machine it runs on (no -march=native).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define RNNDROP_ROW __attribute__((noinline, target_clones("avx512f", "avx2", "default")))
#else
#define RNNDROP_ROW __attribute__((noinline))
#endif

#define RNNDROP_R __restrict__

namespace rnndrop::rows {

// e^x in float32 as arithmetic the compiler vectorises (no libm call in the loop): e^x =
// 2^n e^r with n = round(x log2 e), r = x - n ln 2 in two parts, e^r by Cephes' expf
// polynomial (relative error ~1e-7), 2^n written into the exponent bits. x is clamped to
// [-87.3, 88.3], where 2^n stays a normal float: σ and tanh are saturated long before.
// float64 calls std::exp (within an ulp: the 1e-10 its tests ask).
__attribute__((always_inline)) inline float exp_fast(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
__attribute__((always_inline)) inline double exp_fast(double x) { return std::exp(x); }

template <typename T>
__attribute__((always_inline)) inline T sigmoid(T x) {
  return T(1) / (T(1) + exp_fast(-x));
}
template <typename T>
__attribute__((always_inline)) inline T tanh(T x) {  // 2σ(2x) - 1
  return T(2) / (T(1) + exp_fast(-2 * x)) - T(1);
}

// n units of one LSTM row of a step, every gate at once: z = x + zr (input projection,
// recurrent product), i, f, o = σ(z), g = tanh(z_g), c = f c_prev + i g, tc = tanh(c), r = o tc.
// a: the activations [i, f, g, o]; gate k of unit j at x[k * xs + j], a[k * xs + j] and
// zr[k * zs + j] (xs = zs = n for a whole row). c_state holds c_prev and takes c, which c_saved
// keeps too (for backward).
template <typename T>
RNNDROP_ROW void lstm_step(int64_t n, int64_t xs, int64_t zs, const T* RNNDROP_R x, const T* RNNDROP_R zr,
                           T* RNNDROP_R a, T* RNNDROP_R c_state, T* RNNDROP_R c_saved, T* RNNDROP_R tc,
                           T* RNNDROP_R r) {
  for (int64_t j = 0; j < n; ++j) {
    const T i = sigmoid(x[j] + zr[j]);
    const T f = sigmoid(x[xs + j] + zr[zs + j]);
    const T g = tanh(x[2 * xs + j] + zr[2 * zs + j]);
    const T o = sigmoid(x[3 * xs + j] + zr[3 * zs + j]);
    const T c = f * c_state[j] + i * g;
    const T t = tanh(c);
    a[j] = i;
    a[xs + j] = f;
    a[2 * xs + j] = g;
    a[3 * xs + j] = o;
    c_state[j] = c;
    c_saved[j] = c;
    tc[j] = t;
    r[j] = o * t;
  }
}

// LSTM backward: dz of the four gates from dr and the dc that later steps sent back
// (dc_state, which then takes dc_{t-1} = dc f).
template <typename T>
RNNDROP_ROW void lstm_grad(int64_t n, const T* RNNDROP_R a, const T* RNNDROP_R tc, const T* RNNDROP_R c_prev,
                           const T* RNNDROP_R dr, T* RNNDROP_R dc_state, T* RNNDROP_R dz) {
  const T *RNNDROP_R ai = a, *RNNDROP_R af = a + n, *RNNDROP_R ag = a + 2 * n, *RNNDROP_R ao = a + 3 * n;
  T *RNNDROP_R dzi = dz, *RNNDROP_R dzf = dz + n, *RNNDROP_R dzg = dz + 2 * n, *RNNDROP_R dzo = dz + 3 * n;
  for (int64_t j = 0; j < n; ++j) {
    const T i = ai[j], f = af[j], g = ag[j], o = ao[j], t = tc[j];
    const T dc = dc_state[j] + dr[j] * o * (1 - t * t);
    dzi[j] = dc * g * i * (1 - i);
    dzf[j] = dc * c_prev[j] * f * (1 - f);
    dzg[j] = dc * i * (1 - g * g);
    dzo[j] = dr[j] * t * o * (1 - o);
    dc_state[j] = dc * f;
  }
}

// One GRU row of a step: r, z = σ(x + a), n = tanh(x_n + r a_n), h = n + z (h_prev - n),
// with a = W_hh m + b_hh (its gates `as` apart); act: [r, z, n] (3n); a_n_saved keeps a_n;
// h_state holds h_prev and takes h, also written to h.
template <typename T>
RNNDROP_ROW void gru_step(int64_t n, int64_t as, const T* RNNDROP_R x, const T* RNNDROP_R a, T* RNNDROP_R act,
                          T* RNNDROP_R a_n_saved, T* RNNDROP_R h, T* RNNDROP_R h_state) {
  for (int64_t j = 0; j < n; ++j) {
    const T r = sigmoid(x[j] + a[j]);
    const T z = sigmoid(x[n + j] + a[as + j]);
    const T an = a[2 * as + j];
    const T nj = tanh(x[2 * n + j] + r * an);
    const T hj = nj + z * (h_state[j] - nj);
    act[j] = r;
    act[n + j] = z;
    act[2 * n + j] = nj;
    a_n_saved[j] = an;
    h[j] = hj;
    h_state[j] = hj;
  }
}

// GRU backward: da (r, z, n parts), dn_pre (dx̂_n) and dh_state = dh z, with
// dh = d_out + dh_state.
template <typename T>
RNNDROP_ROW void gru_grad(int64_t n, const T* RNNDROP_R act, const T* RNNDROP_R a_n, const T* RNNDROP_R h_prev,
                          const T* RNNDROP_R d_out, T* RNNDROP_R dh_state, T* RNNDROP_R da, T* RNNDROP_R dn_pre_out) {
  const T *RNNDROP_R ar = act, *RNNDROP_R az = act + n, *RNNDROP_R an = act + 2 * n;
  T *RNNDROP_R dar = da, *RNNDROP_R daz = da + n, *RNNDROP_R dan = da + 2 * n;
  for (int64_t j = 0; j < n; ++j) {
    const T r = ar[j], z = az[j], nj = an[j];
    const T dh = d_out[j] + dh_state[j];
    const T dn_pre = dh * (1 - z) * (1 - nj * nj);
    dar[j] = dn_pre * a_n[j] * r * (1 - r);
    daz[j] = dh * (h_prev[j] - nj) * z * (1 - z);
    dan[j] = dn_pre * r;
    dn_pre_out[j] = dn_pre;
    dh_state[j] = dh * z;
  }
}

// out = x * y (the masked state of one gate), or out (+)= x * y.
template <typename T>
RNNDROP_ROW void mul(int64_t n, const T* RNNDROP_R x, const T* RNNDROP_R y, T* RNNDROP_R out) {
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] * y[j];
}

template <typename T>
RNNDROP_ROW void add_mul(int64_t n, const T* RNNDROP_R x, const T* RNNDROP_R y, T* RNNDROP_R out) {
  for (int64_t j = 0; j < n; ++j) out[j] += x[j] * y[j];
}

}  // namespace rnndrop::rows
