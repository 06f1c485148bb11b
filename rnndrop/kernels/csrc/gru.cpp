// The GRU recurrence, forward and backward, each one loop over time in C++. The
// equations are those of rnndrop/kernels/gru.py. Per step forward: one matrix product
// a = W_hh m + b_hh, then one pass over the step's rows (rows::gru_step) for r, z, n and h
// in the kernel's own vectorised arithmetic. The passes over a step's rows are split over
// the threads (over_rows in common.h).
//
// Without `keep` (inference: nothing will run backward) the buffers of the activations
// and masked states hold one step's rows, reused from step to step.
#include "common.h"

namespace rnndrop {

namespace {

template <typename scalar_t>
void gru_forward_loop(const std::vector<Step>& steps, const MaskView<scalar_t>& mask, const Tensor& gates_x,
                      const StepWeight& w_t, const Tensor& w_t_gates, const Tensor& b_hh, bool keep, Tensor a_buf,
                      Tensor acts, Tensor a_n, Tensor out, Tensor masked, Tensor h_state) {
  const int64_t H = out.size(1);
  const scalar_t* x_base = gates_x.data_ptr<scalar_t>();
  scalar_t* act_base = acts.data_ptr<scalar_t>();
  scalar_t* an_base = a_n.data_ptr<scalar_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  scalar_t* hs = h_state.data_ptr<scalar_t>();
  const bool gate_major = masked.defined() && masked.dim() == 3;  // per-gate masks: [G, N, P]
  for (const Step& s : steps) {
    const int64_t b = s.size, kept = keep ? s.offset : 0;  // kept: the step's first row in the buffers
    Tensor m = h_state.narrow(0, 0, b);
    if (gate_major) {
      m = masked.narrow(1, kept, b);
      mask_state(hs, mask, s.t, b, H, m.data_ptr<scalar_t>(), masked.stride(0));
    } else if (mask.data) {
      m = masked.narrow(0, kept, b);
      mask_state(hs, mask, s.t, b, H, m.data_ptr<scalar_t>());
    }
    Tensor a = a_buf.narrow(0, 0, b);  // W_hh m + b_hh: [b, 3H], per gate gate-major [3, b, H]
    if (gate_major) {
      a = gate_major_product(a_buf, m, w_t, w_t_gates);
      if (b_hh.defined()) a.add_(b_hh.view({a.size(0), 1, H}));
    } else {
      w_t.into(a, m, false, b_hh);
    }
    const scalar_t* a_ptr = a.data_ptr<scalar_t>();
    const int64_t a_row = gate_major ? H : 3 * H, a_gate = gate_major ? b * H : H;  // strides of a
    over_rows(b, H, [&](int64_t k) {
      rows::gru_step<scalar_t>(H, a_gate, x_base + (s.offset + k) * 3 * H, a_ptr + k * a_row,
                               act_base + (kept + k) * 3 * H, an_base + (kept + k) * H, out_base + (s.offset + k) * H,
                               hs + k * H);
    });
  }
}

template <typename scalar_t>
void gru_backward_loop(const std::vector<Step>& steps, const MaskView<scalar_t>& mask, const StepWeight& w_hh,
                       const Tensor& acts, const Tensor& a_n, const Tensor& out, const Tensor& h0, Tensor d_h,
                       Tensor d_a, Tensor d_gates_x, Tensor d_masked, Tensor dh_state) {
  const int64_t H = out.size(1);
  const scalar_t* act_base = acts.data_ptr<scalar_t>();
  const scalar_t* an_base = a_n.data_ptr<scalar_t>();
  const scalar_t* out_base = out.data_ptr<scalar_t>();
  const scalar_t* h0_base = h0.data_ptr<scalar_t>();
  const scalar_t* dh_base = d_h.data_ptr<scalar_t>();
  scalar_t* da_base = d_a.data_ptr<scalar_t>();
  scalar_t* dgx_base = d_gates_x.defined() ? d_gates_x.data_ptr<scalar_t>() : nullptr;
  scalar_t* dhs = dh_state.data_ptr<scalar_t>();
  const int64_t G = mask.data ? mask.row_size / H : 1;
  const Tensor w_gates = gate_weights(w_hh, G, H);
  Tensor scratch = at::empty({G * dh_state.size(0) * H}, acts.options());
  std::vector<scalar_t> dn_pre_rows(dgx_base ? 0 : dh_state.size(0) * H);  // dn_pre when dx̂ is not wanted
  scalar_t* dn_scratch = dn_pre_rows.data();
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const Step& s = *it;
    const int64_t b = s.size;
    over_rows(b, H, [&](int64_t k) {
      const int64_t row = s.offset + k;
      const scalar_t* h_prev = k < s.carried ? out_base + (s.prev_offset + k) * H : h0_base + k * H;
      scalar_t* dn_pre = dgx_base ? dgx_base + row * 3 * H + 2 * H : dn_scratch + k * H;
      rows::gru_grad<scalar_t>(H, act_base + row * 3 * H, an_base + row * H, h_prev, dh_base + row * H, dhs + k * H,
                               da_base + row * 3 * H, dn_pre);
    });
    add_state_grad(d_a.narrow(0, s.offset, b), w_hh, w_gates, mask, s, b, H, scratch, d_masked, true, dh_state);
  }
}

}  // namespace

GRUForward gru_forward(const GRUInputs& inputs, const Schedule& schedule, const std::vector<Tensor>& w_packed,
                       bool keep) {
  const Tensor& gates_x = inputs.gates_x;
  const Tensor& h0 = inputs.h0;
  check_inputs(gates_x, "gru_forward");
  const Tensor b_hh = inputs.b_hh.value_or(Tensor());
  const Tensor mask = inputs.mask.has_value() ? inputs.mask->contiguous() : Tensor();
  const auto steps = running_order(schedule.batch_sizes, schedule.reverse);
  const int64_t H = h0.size(1), B = h0.size(0);
  const int64_t N = keep ? gates_x.size(0) : B;  // rows of the buffers a backward pass reads
  const Tensor x = gates_x.contiguous();
  const StepWeight w_t = forward_weight(inputs.w_hh, w_packed);  // W_hhᵀ
  Tensor acts = at::empty({N, 3 * H}, x.options());
  Tensor a_n = at::empty({N, H}, x.options());
  Tensor out = at::empty({gates_x.size(0), H}, x.options());
  Tensor a_buf = at::empty({B, 3 * H}, x.options());
  const Tensor masked = mask.defined() ? masked_states(N, mask, x.options()) : Tensor();
  Tensor h_state = h0.contiguous().clone();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gru_forward", [&] {
    gru_forward_loop<scalar_t>(steps, MaskView<scalar_t>(mask), x, w_t,
                               gate_weights_t(w_t, mask), b_hh, keep, a_buf,
                               acts, a_n, out, masked, h_state);
  });
  GRUForward result;
  result.out = out;
  result.h_n = h_state;
  result.acts = acts;
  result.a_n = a_n;
  if (masked.defined()) result.masked = masked;
  return result;
}

GRUGrads gru_backward(const GRUOutputGrads& grads, const GRUSaved& saved, const Schedule& schedule,
                      const GRUNeeds& needs, const std::vector<Tensor>& w_t_packed, bool onednn_weight_grad) {
  const Tensor& acts = saved.acts;
  const Tensor& out = saved.out;
  const Tensor mask = saved.mask.has_value() ? saved.mask->contiguous() : Tensor();
  const Tensor masked = saved.masked.value_or(Tensor());
  const auto steps = running_order(schedule.batch_sizes, schedule.reverse);
  const int64_t N = acts.size(0), H = out.size(1);
  Tensor d_h = grads.out.has_value() ? grads.out->contiguous() : at::zeros_like(out);
  Tensor dh_state = grads.h_n.has_value() ? grads.h_n->contiguous().clone() : at::zeros_like(saved.h0);
  Tensor d_a = at::empty({N, 3 * H}, acts.options());
  Tensor d_gates_x = needs.gates_x ? at::empty({N, 3 * H}, acts.options()) : Tensor();
  const bool need_mask = needs.mask && mask.defined();
  Tensor d_masked;  // dm of every row, when the mask's gradient is wanted
  if (mask.defined()) {
    d_masked = need_mask ? at::empty(masked_shape(N, mask), acts.options()) : Tensor();
  }
  const Tensor h0c = saved.h0.contiguous();
  AT_DISPATCH_FLOATING_TYPES(acts.scalar_type(), "gru_backward", [&] {
    gru_backward_loop<scalar_t>(steps, MaskView<scalar_t>(mask), StepWeight{saved.w_hh, w_t_packed}, acts, saved.a_n,
                                out, h0c, d_h, d_a, d_gates_x, d_masked, dh_state);
  });
  GRUGrads result;
  if (d_gates_x.defined()) {
    d_gates_x.narrow(1, 0, 2 * H).copy_(d_a.narrow(1, 0, 2 * H));
    result.gates_x = d_gates_x;
  }
  if (needs.h0) result.h0 = dh_state;
  Tensor h_prev;
  if ((needs.w_hh && !mask.defined()) || need_mask) h_prev = gather_previous(out, h0c, steps);
  if (needs.w_hh) result.w_hh = weight_grad(d_a, mask.defined() ? masked : h_prev, onednn_weight_grad);
  if (needs.b_hh) result.b_hh = d_a.sum(0);
  if (need_mask) {
    AT_DISPATCH_FLOATING_TYPES(acts.scalar_type(), "gru_mask_grad", [&] {
      result.mask = mask_grad<scalar_t>(mask, d_masked, h_prev, steps);
    });
  }
  return result;
}

}  // namespace rnndrop
