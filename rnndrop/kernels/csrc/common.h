// What the LSTM and GRU loops share: the order of the steps over packed rows, the
// hidden mask of a row, the masked state, and the gradients that every cell derives
// the same way (previous states, mask gradient). The equations are those of
// rnndrop/kernels/lstm.py and gru.py.
//
// The recurrence keeps a state buffer of B rows (row k: sequence k). A step with b
// rows reads rows 0..b-1 and writes them back: as the batch shrinks (forward) the
// finished rows keep their last state, and in reverse direction rows not started yet
// still hold the initial state. At the end the buffer is (h_n, c_n). The backward
// pass runs the same buffer of gradients the other way.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "rows.h"

namespace rnndrop {

using at::Tensor;

// f(k) for the rows k = 0..b-1 of a step, `width` elements each, split over the threads when
// there are enough: otherwise the other threads only wait, spinning, for the next product, and
// slow the one thread that runs the pass. Rows share no element, so the results do not depend on
// the split.
template <typename F>
inline void over_rows(int64_t b, int64_t width, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max<int64_t>(width, 1));  // rows per thread, at least
  at::parallel_for(0, b, grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) f(k);
  });
}

// f(j) for j = 0..count-1, split over the threads, each f(j) on one thread (an ATen product
// inside then runs single-threaded: the gates' products of a step, or the parts of the step
// split by units). The other threads get the caller's grad and inference mode for their ATen ops,
// and nothing else: the whole at::ThreadLocalState holds Python objects (saved-tensor hooks), and
// copying them on another thread waits for the GIL, which the caller holds (a deadlock under
// torch.autograd.graph.saved_tensors_hooks).
template <typename F>
inline void over_tasks(int64_t count, const F& f) {
  const bool grad = at::GradMode::is_enabled(), inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    const c10::InferenceMode inference_guard(inference);
    const at::AutoGradMode grad_guard(grad);
    for (int64_t j = begin; j < end; ++j) f(j);
  });
}

// One time step in running order: its time index, rows, first row in the packed
// buffers, and how many of its rows continue rows of the step that ran before
// (`prev_offset`: that step's first row); the others start from the initial state.
struct Step {
  int64_t t, size, offset, prev_offset, carried;
};

inline std::vector<Step> running_order(const std::vector<int64_t>& sizes, bool reverse) {
  const int64_t T = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> offsets(T, 0);
  for (int64_t t = 1; t < T; ++t) offsets[t] = offsets[t - 1] + sizes[t - 1];
  std::vector<Step> steps;
  steps.reserve(T);
  for (int64_t k = 0; k < T; ++k) {
    const int64_t t = reverse ? T - 1 - k : k;
    if (k == 0) {
      steps.push_back({t, sizes[t], offsets[t], 0, 0});
    } else {
      const Step& prev = steps.back();
      steps.push_back({t, sizes[t], offsets[t], prev.offset, std::min(sizes[t], prev.size)});
    }
  }
  return steps;
}

// x Wᵀ (+ add, + bias) through oneDNN's linear op (the op torch.compile emits for
// nn.Linear on CPU), with `packed` a weight from mkldnn::_reorder_linear_weight.
inline Tensor onednn_linear(const Tensor& x, const Tensor& packed, const Tensor& add, const Tensor& bias) {
  static const auto plain = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  static const auto binary = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "binary");
  const c10::IValue b = bias.defined() ? c10::IValue(bias) : c10::IValue();
  std::vector<c10::IValue> stack;
  if (add.defined()) {
    stack = {x, add, packed, b, c10::IValue(std::string("add"))};
    binary.callBoxed(&stack);
  } else {
    stack = {x, packed, b, c10::IValue(std::string("none")), c10::IValue(c10::List<std::optional<c10::Scalar>>()),
             c10::IValue(std::string(""))};
    plain.callBoxed(&stack);
  }
  return stack[0].toTensor();
}

// The weight of a step's product x @ w ([b, in] x [in, out]): through BLAS, or through
// oneDNN when the Python side packed it (float32 and a large weight, where oneDNN's
// packed products are faster, most of all with several threads).
struct StepWeight {
  Tensor w;                     // [in, out]
  std::vector<Tensor> packed;  // wᵀ packed by oneDNN (per-gate masks: each gate's block), or none

  bool per_gate_packed() const { return packed.size() > 1; }

  // out = x @ w, + out when `accumulate`, + bias when defined.
  void into(Tensor out, const Tensor& x, bool accumulate, const Tensor& bias = Tensor()) const {
    if (!packed.empty()) {
      out.copy_(onednn_linear(x, packed[0], accumulate ? out : Tensor(), bias));
    } else if (accumulate) {
      out.addmm_(x, w);
    } else if (bias.defined()) {
      at::addmm_out(out, bias, x, w);
    } else {
      at::mm_out(out, x, w);
    }
  }

  // x @ w, in `out` or (oneDNN) in a tensor of its own, contiguous.
  Tensor product(const Tensor& x, Tensor out) const {
    if (!packed.empty()) return onednn_linear(x, packed[0], Tensor(), Tensor());
    at::mm_out(out, x, w);
    return out;
  }
};

// A forward pass's step weight: W_hhᵀ [P, G * H] as a contiguous copy for BLAS (products that
// read the transposed view cost more over a sequence than one copy a call), or oneDNN's packed
// W_hh, with Wᵀ left a view that no product reads (no copy: oneDNN never reads it).
inline StepWeight forward_weight(const Tensor& w_hh, const std::vector<Tensor>& packed) {
  if (!packed.empty()) return StepWeight{w_hh.t(), packed};
  return StepWeight{w_hh.t().contiguous(), {}};
}

// The per-gate oneDNN products of one step, one a thread: G gates cut into S blocks of output
// columns each (w.packed holds G S packed blocks, gate-major; compiled.gate_parts chose S so
// that the threads share them evenly). f(g, task, c0, c1): gate g's columns c0..c1-1 of `out`
// output columns, through w.packed[task]. Small products split over the threads beat each one
// threaded in turn.
template <typename F>
inline void over_gate_parts(int64_t G, const StepWeight& w, int64_t out, const F& f) {
  const int64_t S = static_cast<int64_t>(w.packed.size()) / G;
  over_tasks(G * S, [&](int64_t task) {
    const int64_t g = task / S, j = task % S;
    f(g, task, j * out / S, (j + 1) * out / S);
  });
}

// The hidden mask [T', B', (G,) P] (contiguous): where the mask of step t and row k starts.
template <typename scalar_t>
struct MaskView {
  const scalar_t* data = nullptr;
  int64_t steps = 0, batch = 0, row_size = 0;  // row_size: G * P per gate, else P

  explicit MaskView(const Tensor& mask) {
    if (!mask.defined()) return;
    data = mask.data_ptr<scalar_t>();
    steps = mask.size(0);
    batch = mask.size(1);
    row_size = mask.numel() / (steps * batch);
  }
  const scalar_t* row(int64_t t, int64_t k) const {
    return data + ((steps > 1 ? t : 0) * batch + (batch > 1 ? k : 0)) * row_size;
  }
};

// m = h_prev * M for the rows of one step: [b, P] -> [b, (G,) P]; with a `gate_stride`
// (per-gate masks), gate-major: gate g of row k at m + g * gate_stride + k * P.
template <typename scalar_t>
inline void mask_state(const scalar_t* h, const MaskView<scalar_t>& mask, int64_t t, int64_t b, int64_t P,
                       scalar_t* m, int64_t gate_stride = 0) {
  const int64_t G = mask.row_size / P;
  const int64_t row_stride = gate_stride ? P : G * P, g_stride = gate_stride ? gate_stride : P;
  over_rows(b, G * P, [&](int64_t k) {
    const scalar_t* mk = mask.row(t, k);
    const scalar_t* hk = h + k * P;
    scalar_t* out = m + k * row_stride;
    for (int64_t g = 0; g < G; ++g) rows::mul<scalar_t>(P, hk, mk + g * P, out + g * g_stride);
  });
}

// dh_prev = dm * M (one mask) or sum over gates of dm_g * M_g (per gate), for one step;
// row k of dm, gate g, at dm + k * P + g * gate_stride.
template <typename scalar_t>
inline void unmask_grad(const scalar_t* dm, int64_t gate_stride, const MaskView<scalar_t>& mask, int64_t t,
                        int64_t b, int64_t P, bool accumulate, scalar_t* dh) {
  const int64_t G = mask.row_size / P;
  over_rows(b, G * P, [&](int64_t k) {
    const scalar_t* mk = mask.row(t, k);
    scalar_t* out = dh + k * P;
    if (!accumulate) std::fill(out, out + P, scalar_t(0));
    for (int64_t g = 0; g < G; ++g) rows::add_mul<scalar_t>(P, dm + k * P + g * gate_stride, mk + g * P, out);
  });
}

// One step of the backward pass through the masked product: dm = dz W (per gate
// dm_g = dz_g W_g, one batched product with w_gates = W viewed [G, H, P]), then
// dh_prev (+)= dm * M. `scratch` holds at least G * B * P elements; `d_masked_rows`
// ([b, (G,) P], or undefined) receives dm for the mask's gradient.
template <typename scalar_t>
inline void masked_state_grad(const Tensor& d_z, const StepWeight& w, const Tensor& w_gates,
                              const MaskView<scalar_t>& mask, int64_t t, int64_t b, int64_t P, Tensor& scratch,
                              Tensor d_masked_rows, bool accumulate, scalar_t* dh) {
  const int64_t G = mask.row_size / P;
  Tensor flat = scratch.narrow(0, 0, G * b * P);
  Tensor dm = G == 1 ? flat.view({b, P}) : flat.view({G, b, P});
  if (G == 1) {
    w.into(dm, d_z, false);
  } else if (w.per_gate_packed()) {
    const int64_t H = d_z.size(1) / G;
    over_gate_parts(G, w, P, [&](int64_t g, int64_t task, int64_t c0, int64_t c1) {
      dm.select(0, g).narrow(1, c0, c1 - c0).copy_(
          onednn_linear(d_z.narrow(1, g * H, H).contiguous(), w.packed[task], Tensor(), Tensor()));
    });
  } else {
    at::bmm_out(dm, d_z.view({b, G, -1}).transpose(0, 1), w_gates);
  }
  if (d_masked_rows.defined()) d_masked_rows.copy_(G == 1 ? dm : dm.transpose(0, 1));
  unmask_grad(flat.data_ptr<scalar_t>(), b * P, mask, t, b, P, accumulate, dh);
}

// One step's gradient to the previous state, written (`accumulate` false) or added into the
// first b rows of dh_state: dz W without a mask, else through masked_state_grad (its rows of
// d_masked, when defined, receive dm for the mask's gradient).
template <typename scalar_t>
inline void add_state_grad(const Tensor& d_z, const StepWeight& w, const Tensor& w_gates,
                           const MaskView<scalar_t>& mask, const Step& s, int64_t b, int64_t P,
                           Tensor& scratch, const Tensor& d_masked, bool accumulate, Tensor& dh_state) {
  if (!mask.data) {
    w.into(dh_state.narrow(0, 0, b), d_z, accumulate);
    return;
  }
  masked_state_grad(d_z, w, w_gates, mask, s.t, b, P, scratch,
                    d_masked.defined() ? d_masked.narrow(0, s.offset, b) : Tensor(), accumulate,
                    dh_state.data_ptr<scalar_t>());
}

// The state every row started its step from: [N, X] from the rows of all steps and
// the initial state [B, X].
inline Tensor gather_previous(const Tensor& rows, const Tensor& init, const std::vector<Step>& steps) {
  Tensor out = at::empty_like(rows);
  for (const Step& s : steps) {
    if (s.carried) out.narrow(0, s.offset, s.carried).copy_(rows.narrow(0, s.prev_offset, s.carried));
    if (s.size > s.carried)
      out.narrow(0, s.offset + s.carried, s.size - s.carried).copy_(init.narrow(0, s.carried, s.size - s.carried));
  }
  return out;
}

// dM [T', B', (G,) P]: the sum of dm * h_prev over the rows that share a mask.
template <typename scalar_t>
inline Tensor mask_grad(const Tensor& mask, const Tensor& d_masked, const Tensor& h_prev,
                        const std::vector<Step>& steps) {
  Tensor d_mask = at::zeros_like(mask);
  MaskView<scalar_t> view(mask);
  scalar_t* base = d_mask.data_ptr<scalar_t>();
  const scalar_t* dm = d_masked.data_ptr<scalar_t>();
  const scalar_t* h = h_prev.data_ptr<scalar_t>();
  const int64_t P = h_prev.size(1), G = view.row_size / P;
  for (const Step& s : steps) {
    for (int64_t k = 0; k < s.size; ++k) {
      const int64_t row = s.offset + k;
      scalar_t* out = base + (view.row(s.t, k) - view.data);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t p = 0; p < P; ++p) out[g * P + p] += dm[(row * G + g) * P + p] * h[row * P + p];
    }
  }
  return d_mask;
}

// out = d_zᵀ m over all rows ([N, O] and [N, P] -> [O, P]): through BLAS, or (`onednn`, where the
// Python side found it faster: float32 on AMD Zen 5) through oneDNN's linear op as (mᵀ d_z)ᵀ, mᵀ
// copied contiguous, d_z read as a transposed weight (a column block copied first), the result
// copied back into out's layout.
inline void rows_product(Tensor out, const Tensor& d_z, const Tensor& m, bool onednn) {
  if (!onednn) {
    at::mm_out(out, d_z.t(), m);
    return;
  }
  const Tensor w = d_z.is_contiguous() ? d_z : d_z.contiguous();
  out.copy_(onednn_linear(m.t().contiguous(), w.t(), Tensor(), Tensor()).t());
}

// dW_hh = sum over rows of dz mᵀ: [N, G * H] and [N, P] (or per gate, gate-major, [G, N, P]) -> [G * H, P].
inline Tensor weight_grad(const Tensor& d_z, const Tensor& m, bool onednn) {
  const int64_t G = m.dim() == 2 ? 1 : m.size(0), H = d_z.size(1) / G;
  Tensor d_w = at::empty({G * H, m.size(-1)}, d_z.options());
  for (int64_t g = 0; g < G; ++g) {
    rows_product(d_w.narrow(0, g * H, H), G == 1 ? d_z : d_z.narrow(1, g * H, H), G == 1 ? m : m.select(0, g),
                 onednn);
  }
  return d_w;
}

// dW_hh = sum over rows of dz_g (h_prev * M_g)ᵀ for per-gate masks, from the unmasked previous
// states h_prev [N, P]: each gate's masked states rebuilt in turn into one buffer [N, P] (a forward
// pass that keeps them writes [N, G, P] of fresh memory, the slower way at hidden 200).
template <typename scalar_t>
inline Tensor per_gate_weight_grad(const Tensor& d_z, const Tensor& h_prev, const Tensor& mask,
                                   const std::vector<Step>& steps, bool onednn) {
  const MaskView<scalar_t> view(mask);
  const int64_t P = h_prev.size(1), G = view.row_size / P, H = d_z.size(1) / G;
  Tensor d_w = at::empty({G * H, P}, d_z.options());
  Tensor m = at::empty_like(h_prev);
  const scalar_t* h = h_prev.data_ptr<scalar_t>();
  scalar_t* m_base = m.data_ptr<scalar_t>();
  for (int64_t g = 0; g < G; ++g) {
    for (const Step& s : steps) {
      over_rows(s.size, P, [&](int64_t k) {
        const int64_t row = s.offset + k;
        rows::mul<scalar_t>(P, h + row * P, view.row(s.t, k) + g * P, m_base + row * P);
      });
    }
    rows_product(d_w.narrow(0, g * H, H), d_z.narrow(1, g * H, H), m, onednn);
  }
  return d_w;
}

// Rows of masked states for a hidden mask [T', B', (G,) P], row-major: [rows, (G,) P] (what the
// backward passes' gradients of the masked states use; the forward's own are `masked_states`).
inline std::vector<int64_t> masked_shape(int64_t rows, const Tensor& mask) {
  std::vector<int64_t> shape{rows};
  for (int64_t d = 2; d < mask.dim(); ++d) shape.push_back(mask.size(d));
  return shape;
}

// The masked states of `rows` rows for a hidden mask [T', B', (G,) P], as the forward loops keep
// them: [rows, P], per gate gate-major [G, rows, P] (each gate's rows contiguous for its product).
inline Tensor masked_states(int64_t rows, const Tensor& mask, const at::TensorOptions& options) {
  const int64_t P = mask.size(-1);
  return mask.dim() == 4 ? at::empty({mask.size(2), rows, P}, options) : at::empty({rows, P}, options);
}

// Per-gate masks: the gates' products m_g W_gᵀ from gate-major masked states
// m [G, b, P], gate-major into the first G b H elements of `buf`, returned as [G, b, H]: with BLAS
// one batched product (w_t_gates = every gate's Wᵀ, [G, P, H]), with oneDNN one product a gate
// (each gate's m_g contiguous: no copy in). Gate-major on both sides, because it cost less than
// z's gate blocks written through strides (a baddbmm into [b, G H]).
inline Tensor gate_major_product(const Tensor& buf, const Tensor& m, const StepWeight& w_t,
                                 const Tensor& w_t_gates) {
  const int64_t G = m.size(0), b = m.size(1), H = buf.size(1) / G;
  Tensor z = buf.view(-1).narrow(0, 0, G * b * H).view({G, b, H});
  if (!w_t.per_gate_packed()) {
    at::bmm_out(z, m, w_t_gates);
    return z;
  }
  over_gate_parts(G, w_t, H, [&](int64_t g, int64_t task, int64_t c0, int64_t c1) {
    z.select(0, g).narrow(1, c0, c1 - c0).copy_(onednn_linear(m.select(0, g), w_t.packed[task], Tensor(), Tensor()));
  });
  return z;
}

// Wᵀ of every gate, [G, P, H], from Wᵀ (per-gate masks with BLAS products), else undefined.
inline Tensor gate_weights_t(const StepWeight& w_t, const Tensor& mask) {
  if (!mask.defined() || mask.dim() == 3 || w_t.per_gate_packed()) return Tensor();
  const int64_t G = mask.size(2), P = w_t.w.size(0);
  return w_t.w.reshape({P, G, -1}).permute({1, 0, 2}).contiguous();
}

// W of every gate, [G, H, P], a view of W [G * H, P] (backward, per-gate masks with BLAS
// products), else undefined.
inline Tensor gate_weights(const StepWeight& w, int64_t G, int64_t P) {
  return G > 1 && !w.per_gate_packed() ? w.w.reshape({G, -1, P}) : Tensor();
}

inline void check_inputs(const Tensor& x, const char* who) {
  TORCH_CHECK(x.device().is_cpu(), who, ": the compiled kernel runs on CPU tensors only, got ", x.device(),
              " (use kernel='manual')");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, who,
              ": the compiled kernel takes float32 or float64, got ", x.scalar_type());
}

}  // namespace rnndrop
