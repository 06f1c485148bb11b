// The pointwise math of one row of one step (H elements), as small functions with
// unaliased pointers that the compiler vectorises. On x86-64 with GCC each is also
// compiled for AVX2 and picked at load time (target_clones), so the build does not
// depend on the machine it runs on (no -march=native).
#pragma once

#include <cstdint>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define RNNDROP_ROW __attribute__((noinline, target_clones("avx2", "default")))
#else
#define RNNDROP_ROW __attribute__((noinline))
#endif

#define RNNDROP_R __restrict__

namespace rnndrop::rows {

// LSTM forward, after σ over the gates (g holds σ(2 z_g)): g = 2σ - 1, c = f c_prev + i g,
// tc = 2c (for tanh(c) = 2σ(2c) - 1).
template <typename T>
RNNDROP_ROW void lstm_cell(int64_t n, const T* RNNDROP_R i, const T* RNNDROP_R f, T* RNNDROP_R g,
                           const T* RNNDROP_R c_prev, T* RNNDROP_R c, T* RNNDROP_R tc) {
  for (int64_t j = 0; j < n; ++j) {
    const T gj = 2 * g[j] - 1;
    const T cj = f[j] * c_prev[j] + i[j] * gj;
    g[j] = gj;
    c[j] = cj;
    tc[j] = 2 * cj;
  }
}

// LSTM forward, after σ(2c): tc = tanh(c) = 2σ - 1, r = o tc; the state takes c (and r
// when there is no projection: h_state may be null).
template <typename T>
RNNDROP_ROW void lstm_output(int64_t n, const T* RNNDROP_R o, const T* RNNDROP_R c, T* RNNDROP_R tc,
                             T* RNNDROP_R r, T* RNNDROP_R c_state, T* RNNDROP_R h_state) {
  for (int64_t j = 0; j < n; ++j) {
    const T t = 2 * tc[j] - 1;
    tc[j] = t;
    r[j] = o[j] * t;
    c_state[j] = c[j];
  }
  if (h_state)
    for (int64_t j = 0; j < n; ++j) h_state[j] = r[j];
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

// out = x + y (GRU: the pre-activations of r and z).
template <typename T>
RNNDROP_ROW void add(int64_t n, const T* RNNDROP_R x, const T* RNNDROP_R y, T* RNNDROP_R out) {
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] + y[j];
}

// GRU forward, after σ(r): keeps a_n, n_pre2 = 2 (x_n + r a_n) (for tanh).
template <typename T>
RNNDROP_ROW void gru_candidate(int64_t n, const T* RNNDROP_R x_n, const T* RNNDROP_R r, const T* RNNDROP_R a_n,
                               T* RNNDROP_R a_n_saved, T* RNNDROP_R n_pre2) {
  for (int64_t j = 0; j < n; ++j) {
    a_n_saved[j] = a_n[j];
    n_pre2[j] = 2 * (x_n[j] + r[j] * a_n[j]);
  }
}

// GRU forward, after σ(2 n_pre): n = 2σ - 1, h = n + z (h_prev - n) into out and the state.
template <typename T>
RNNDROP_ROW void gru_output(int64_t n, const T* RNNDROP_R z, T* RNNDROP_R n_act, T* RNNDROP_R h,
                            T* RNNDROP_R h_state) {
  for (int64_t j = 0; j < n; ++j) {
    const T nj = 2 * n_act[j] - 1;
    const T hj = nj + z[j] * (h_state[j] - nj);
    n_act[j] = nj;
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

// out = x, with the elements lo..hi-1 doubled (a row of the LSTM's input projection, its g
// gate scaled for tanh(z) = 2σ(2z) - 1).
template <typename T>
RNNDROP_ROW void copy_doubling_block(int64_t n, int64_t lo, int64_t hi, const T* RNNDROP_R x, T* RNNDROP_R out) {
  for (int64_t j = 0; j < lo; ++j) out[j] = x[j];
  for (int64_t j = lo; j < hi; ++j) out[j] = 2 * x[j];
  for (int64_t j = hi; j < n; ++j) out[j] = x[j];
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
