// The LSTM recurrence, forward and backward, each one loop over time in C++. The
// equations are those of rnndrop/kernels/lstm.py. Per step forward: one matrix product
// zr = m W_hhᵀ into a step buffer, then one pass over the step's rows (rows::lstm_step):
// z = x + zr, the four gates' nonlinearities, c, tanh(c) and h, all in the kernel's own
// vectorised arithmetic. Per step backward: one pass for the gates' gradients, then one
// product. The passes over a step's rows are split over the threads (over_rows in common.h);
// with several threads and padded input the forward step is split by hidden units instead
// (lstm_forward_split: one parallel region a step).
//
// Without `keep` (inference: nothing will run backward) the buffers of the gates, cells
// and masked states hold one step's rows, reused from step to step, instead of every
// row of the sequence. Per-gate masked states ([N, G, P]: fresh memory on every call, four
// times one mask's) are never kept: backward rebuilds them gate by gate (per_gate_weight_grad).
#include "common.h"

namespace rnndrop {

namespace {

template <typename scalar_t>
void lstm_forward_loop(const std::vector<Step>& steps, const MaskView<scalar_t>& mask, const StepWeight& w_t,
                       const Tensor& w_t_gates, const Tensor& w_hr_t, const Tensor& gates_x, bool keep, Tensor acts,
                       Tensor cells, Tensor tanh_cells, Tensor r, Tensor out, Tensor masked, bool keep_masked,
                       Tensor h_state, Tensor c_state) {
  const int64_t H = cells.size(1), P = out.size(1);
  const bool proj = w_hr_t.defined();
  const scalar_t* x_base = gates_x.data_ptr<scalar_t>();
  scalar_t* a_base = acts.data_ptr<scalar_t>();
  scalar_t* c_base = cells.data_ptr<scalar_t>();
  scalar_t* tc_base = tanh_cells.data_ptr<scalar_t>();
  scalar_t* hs = h_state.data_ptr<scalar_t>();
  scalar_t* cs = c_state.data_ptr<scalar_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  Tensor zr_buf = at::empty({h_state.size(0), 4 * H}, acts.options());
  // A step's r rows go through one buffer whether or not they are kept: BLAS may sum a product in
  // another order where its rows start at another alignment, and inference gives training's
  // outputs bit for bit.
  Tensor r_step = proj ? at::empty({h_state.size(0), H}, acts.options()) : Tensor();
  scalar_t* rs_base = proj ? r_step.data_ptr<scalar_t>() : nullptr;
  const bool gate_major = masked.defined() && masked.dim() == 3;  // per-gate masks: [G, B, P]
  for (const Step& s : steps) {
    const int64_t b = s.size, kept = keep ? s.offset : 0;  // kept: the step's first row in the buffers
    Tensor m = h_state.narrow(0, 0, b);
    if (gate_major) {
      m = masked.narrow(1, 0, b);
      mask_state(hs, mask, s.t, b, P, m.data_ptr<scalar_t>(), masked.stride(0));
    } else if (mask.data) {
      m = masked.narrow(0, keep_masked ? s.offset : 0, b);
      mask_state(hs, mask, s.t, b, P, m.data_ptr<scalar_t>());
    }
    const Tensor zr_t = gate_major ? gate_major_product(zr_buf, m, w_t, w_t_gates)
                                   : w_t.product(m, zr_buf.narrow(0, 0, b));  // held: oneDNN's own
    const scalar_t* zr = zr_t.data_ptr<scalar_t>();
    const int64_t z_row = gate_major ? H : 4 * H, z_gate = gate_major ? b * H : H;  // strides of zr
    over_rows(b, H, [&](int64_t k) {
      const int64_t row = (kept + k) * H;
      scalar_t* r_row = proj ? rs_base + k * H : out_base + (s.offset + k) * P;
      rows::lstm_step<scalar_t>(H, H, z_gate, x_base + (s.offset + k) * 4 * H, zr + k * z_row,
                                a_base + (kept + k) * 4 * H, cs + k * H, c_base + row, tc_base + row, r_row);
      if (!proj) std::copy(r_row, r_row + H, hs + k * H);
    });
    if (proj) {
      Tensor out_t = out.narrow(0, s.offset, b), r_t = r_step.narrow(0, 0, b);
      at::mm_out(out_t, r_t, w_hr_t);
      if (keep) r.narrow(0, s.offset, b).copy_(r_t);
      h_state.narrow(0, 0, b).copy_(out_t);
    }
  }
}

// The forward loop for several threads split by hidden units instead of rows (padded input:
// every step has all B rows; no projection; products through BLAS; at least 32 units a part: the
// Python side decides, compiled.split_parts). Part j owns units [u0, u1) and the columns of
// W_hhᵀ its gates need, in a copy of its own that stays in its core's cache ([P, 4 n]; per-gate
// masks: [G, P, n], gate g's product reading gate g's masked state): per step, in one parallel
// region instead of three (mask, product, rows), each part runs its product zr_j = m W_jᵀ (per
// gate: one batched product, gate-major [G, B, n]), the pointwise pass of its units, and its units
// of the next step's masked state. A step's product reads every unit, so what a step writes for
// the next one goes to another buffer than the one it reads (two alternate where one step's rows
// are kept).
template <typename scalar_t>
void lstm_forward_split(const std::vector<Step>& steps, const MaskView<scalar_t>& mask, const Tensor& w_hh,
                        const Tensor& gates_x, bool keep, int64_t parts, Tensor acts, Tensor cells,
                        Tensor tanh_cells, Tensor out, Tensor masked, bool keep_masked, const Tensor& h0,
                        Tensor h_state, Tensor c_state) {
  const int64_t H = cells.size(1), B = h0.size(0);  // P == H
  const int64_t G = mask.data ? mask.row_size / H : 1;  // masks a row: 4 per gate, else 1
  std::vector<int64_t> first(parts + 1, H);  // part j: units first[j] .. first[j + 1] - 1
  for (int64_t j = 0; j < parts; ++j) first[j] = j * H / parts / 8 * 8;  // aligned for the vector code
  std::vector<Tensor> w_parts(parts), z_parts(parts);
  for (int64_t j = 0; j < parts; ++j) {
    const int64_t u0 = first[j], n = first[j + 1] - u0;
    std::vector<Tensor> gates;
    for (int64_t g = 0; g < 4; ++g) gates.push_back(w_hh.narrow(0, g * H + u0, n));
    w_parts[j] = G > 1 ? at::stack(gates, 0).transpose(1, 2).contiguous()  // [G, P, n]
                       : at::cat(gates, 0).t().contiguous();              // [P, 4 n]
    z_parts[j] = G > 1 ? at::empty({G, B, n}, acts.options()) : at::empty({B, 4 * n}, acts.options());
  }
  Tensor m_bufs[2];
  if (mask.data && !keep_masked) m_bufs[0] = masked, m_bufs[1] = at::empty_like(masked);
  auto masked_rows = [&](size_t i) { return keep_masked ? masked.narrow(0, steps[i].offset, B) : m_bufs[i % 2]; };
  const Tensor h0c = h0.contiguous();
  if (mask.data)
    mask_state(h0c.data_ptr<scalar_t>(), mask, steps[0].t, B, H, masked_rows(0).template data_ptr<scalar_t>(),
               G > 1 ? B * H : 0);
  const scalar_t* x_base = gates_x.data_ptr<scalar_t>();
  scalar_t* a_base = acts.data_ptr<scalar_t>();
  scalar_t* c_base = cells.data_ptr<scalar_t>();
  scalar_t* tc_base = tanh_cells.data_ptr<scalar_t>();
  scalar_t* out_base = out.data_ptr<scalar_t>();
  scalar_t* cs = c_state.data_ptr<scalar_t>();
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    const bool last = i + 1 == steps.size();
    const int64_t kept = keep ? s.offset : 0;
    const Tensor m = mask.data ? masked_rows(i) : (i == 0 ? h0c : out.narrow(0, steps[i - 1].offset, B));
    scalar_t* m_next = mask.data && !last ? masked_rows(i + 1).template data_ptr<scalar_t>() : nullptr;
    const int64_t t_next = last ? 0 : steps[i + 1].t;
    over_tasks(parts, [&](int64_t j) {
      const int64_t u0 = first[j], n = first[j + 1] - u0;
      if (G > 1) {
        at::bmm_out(z_parts[j], m, w_parts[j]);
      } else {
        at::mm_out(z_parts[j], m, w_parts[j]);
      }
      const scalar_t* z = z_parts[j].data_ptr<scalar_t>();
      const int64_t z_row = G > 1 ? n : 4 * n, z_gate = G > 1 ? B * n : n;  // strides of zr_j
      for (int64_t k = 0; k < B; ++k) {
        const int64_t row = s.offset + k;
        scalar_t* h = out_base + row * H + u0;
        rows::lstm_step<scalar_t>(n, H, z_gate, x_base + row * 4 * H + u0, z + k * z_row,
                                  a_base + (kept + k) * 4 * H + u0, cs + k * H + u0, c_base + (kept + k) * H + u0,
                                  tc_base + (kept + k) * H + u0, h);
        if (!m_next) continue;
        for (int64_t g = 0; g < G; ++g)
          rows::mul<scalar_t>(n, h, mask.row(t_next, k) + g * H + u0, m_next + (g * B + k) * H + u0);
      }
    });
  }
  h_state.copy_(out.narrow(0, steps.back().offset, B));
}

template <typename scalar_t>
void lstm_backward_loop(const std::vector<Step>& steps, const MaskView<scalar_t>& mask, const StepWeight& w_hh,
                        const Tensor& w_hr, const Tensor& acts, const Tensor& cells, const Tensor& tanh_cells,
                        const Tensor& c0, Tensor d_h, Tensor d_gates, Tensor d_masked, Tensor dr_buf,
                        Tensor dh_state, Tensor dc_state) {
  const int64_t H = cells.size(1), P = d_h.size(1);
  const bool proj = w_hr.defined();
  const scalar_t* a_base = acts.data_ptr<scalar_t>();
  const scalar_t* c_base = cells.data_ptr<scalar_t>();
  const scalar_t* tc_base = tanh_cells.data_ptr<scalar_t>();
  const scalar_t* c0_base = c0.data_ptr<scalar_t>();
  scalar_t* dz_base = d_gates.data_ptr<scalar_t>();
  scalar_t* dcs = dc_state.data_ptr<scalar_t>();
  const int64_t G = mask.data ? mask.row_size / P : 1;
  const Tensor w_gates = gate_weights(w_hh, G, P);
  Tensor scratch = at::empty({G * dh_state.size(0) * P}, acts.options());
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const Step& s = *it;
    const int64_t b = s.size;
    Tensor dh = d_h.narrow(0, s.offset, b);
    dh.add_(dh_state.narrow(0, 0, b));  // dh_t: the output's gradient and what later steps sent back
    Tensor dr = dh;
    if (proj) {
      dr = dr_buf.narrow(0, 0, b);
      at::mm_out(dr, dh, w_hr);
    }
    const scalar_t* dr_base = dr.data_ptr<scalar_t>();
    over_rows(b, H, [&](int64_t k) {
      const int64_t row = s.offset + k;
      const scalar_t* c_prev = k < s.carried ? c_base + (s.prev_offset + k) * H : c0_base + k * H;
      rows::lstm_grad<scalar_t>(H, a_base + row * 4 * H, tc_base + row * H, c_prev, dr_base + k * H, dcs + k * H,
                                dz_base + row * 4 * H);
    });
    add_state_grad(d_gates.narrow(0, s.offset, b), w_hh, w_gates, mask, s, b, P, scratch, d_masked, false,
                   dh_state);
  }
}

}  // namespace

LSTMForward lstm_forward(const LSTMInputs& inputs, const Schedule& schedule, const std::vector<Tensor>& w_packed,
                         bool keep, int64_t parts) {
  const Tensor& gates_x = inputs.gates_x;
  const Tensor& h0 = inputs.h0;
  const Tensor& c0 = inputs.c0;
  const std::vector<int64_t>& batch_sizes = schedule.batch_sizes;
  check_inputs(gates_x, "lstm_forward");
  const Tensor w_hr = inputs.w_hr.value_or(Tensor());
  const Tensor mask = inputs.mask.has_value() ? inputs.mask->contiguous() : Tensor();
  const auto steps = running_order(batch_sizes, schedule.reverse);
  const int64_t H = c0.size(1), P = h0.size(1);
  const int64_t N = keep ? gates_x.size(0) : h0.size(0);  // rows of the buffers a backward pass reads
  const Tensor x = gates_x.contiguous();
  Tensor acts = at::empty({N, 4 * H}, x.options());
  Tensor w_hr_t = w_hr.defined() ? w_hr.t().contiguous() : Tensor();
  Tensor cells = at::empty({N, H}, gates_x.options());
  Tensor tanh_cells = at::empty({N, H}, gates_x.options());
  Tensor out = at::empty({gates_x.size(0), P}, gates_x.options());
  Tensor r = w_hr.defined() && keep ? at::empty({N, H}, gates_x.options()) : Tensor();  // backward's alone
  const bool keep_masked = keep && (!mask.defined() || mask.dim() == 3);  // per gate: rebuilt by backward
  // the masked states: of every row where kept, else of one step's rows
  const Tensor masked = mask.defined() ? masked_states(keep_masked ? N : h0.size(0), mask, x.options()) : Tensor();
  Tensor h_state = h0.contiguous().clone();
  Tensor c_state = c0.contiguous().clone();
  TORCH_CHECK(parts == 0 || (!w_hr.defined() && w_packed.empty() &&
                             !batch_sizes.empty() &&
                             std::all_of(batch_sizes.begin(), batch_sizes.end(),
                                         [&](int64_t b) { return b == batch_sizes[0]; }) && parts * 32 <= H),
              "lstm_forward: no split by units here (", parts, " parts)");
  AT_DISPATCH_FLOATING_TYPES(gates_x.scalar_type(), "lstm_forward", [&] {
    if (parts) {
      lstm_forward_split<scalar_t>(steps, MaskView<scalar_t>(mask), inputs.w_hh, x, keep, parts, acts, cells,
                                   tanh_cells, out, masked, keep_masked, h0, h_state, c_state);
      return;
    }
    const StepWeight w_t = forward_weight(inputs.w_hh, w_packed);  // W_hhᵀ
    lstm_forward_loop<scalar_t>(steps, MaskView<scalar_t>(mask), w_t,
                                gate_weights_t(w_t, mask), w_hr_t, x, keep, acts, cells, tanh_cells, r, out, masked,
                                keep_masked, h_state, c_state);
  });
  LSTMForward result;
  result.out = out;
  result.h_n = h_state;
  result.c_n = c_state;
  result.acts = acts;
  result.cells = cells;
  result.tanh_cells = tanh_cells;
  if (r.defined()) result.r = r;
  if (keep_masked && masked.defined()) result.masked = masked;
  return result;
}

LSTMGrads lstm_backward(const LSTMOutputGrads& grads, const LSTMSaved& saved, const Schedule& schedule,
                        const LSTMNeeds& needs, const std::vector<Tensor>& w_t_packed, bool onednn_weight_grad) {
  const Tensor& acts = saved.acts;
  const Tensor& cells = saved.cells;
  const Tensor& out = saved.out;
  const Tensor& h0 = saved.h0;
  const Tensor& c0 = saved.c0;
  const Tensor w_hr = saved.w_hr.value_or(Tensor());
  const Tensor mask = saved.mask.has_value() ? saved.mask->contiguous() : Tensor();
  const Tensor masked = saved.masked.value_or(Tensor());
  const auto steps = running_order(schedule.batch_sizes, schedule.reverse);
  const int64_t N = acts.size(0), H = cells.size(1);
  Tensor d_h = grads.out.has_value() ? grads.out->contiguous().clone() : at::zeros_like(out);
  Tensor dh_state = grads.h_n.has_value() ? grads.h_n->contiguous().clone() : at::zeros_like(h0);
  Tensor dc_state = grads.c_n.has_value() ? grads.c_n->contiguous().clone() : at::zeros_like(c0);
  Tensor d_gates = at::empty({N, 4 * H}, acts.options());
  const bool need_mask = needs.mask && mask.defined();
  Tensor d_masked;  // dm of every row, when the mask's gradient is wanted
  if (mask.defined()) {
    d_masked = need_mask ? at::empty(masked_shape(N, mask), acts.options()) : Tensor();
  }
  Tensor dr_buf = w_hr.defined() ? at::empty({h0.size(0), H}, acts.options()) : Tensor();
  const Tensor c0c = c0.contiguous();
  AT_DISPATCH_FLOATING_TYPES(acts.scalar_type(), "lstm_backward", [&] {
    lstm_backward_loop<scalar_t>(steps, MaskView<scalar_t>(mask), StepWeight{saved.w_hh, w_t_packed}, w_hr, acts,
                                 cells, saved.tanh_cells, c0c, d_h, d_gates, d_masked, dr_buf, dh_state, dc_state);
  });
  LSTMGrads result;
  if (needs.gates_x) result.gates_x = d_gates;
  if (needs.h0) result.h0 = dh_state;
  if (needs.c0) result.c0 = dc_state;
  Tensor h_prev;
  const bool per_gate = mask.defined() && mask.dim() == 4;
  if ((needs.w_hh && (!mask.defined() || per_gate)) || need_mask) h_prev = gather_previous(out, h0.contiguous(), steps);
  if (needs.w_hh && per_gate) {
    AT_DISPATCH_FLOATING_TYPES(acts.scalar_type(), "lstm_weight_grad", [&] {
      result.w_hh = per_gate_weight_grad<scalar_t>(d_gates, h_prev, mask, steps, onednn_weight_grad);
    });
  } else if (needs.w_hh) {
    result.w_hh = weight_grad(d_gates, mask.defined() ? masked : h_prev, onednn_weight_grad);
  }
  if (needs.w_hr && w_hr.defined()) result.w_hr = at::mm(d_h.t(), *saved.r);
  if (need_mask) {
    AT_DISPATCH_FLOATING_TYPES(acts.scalar_type(), "lstm_mask_grad", [&] {
      result.mask = mask_grad<scalar_t>(mask, d_masked, h_prev, steps);
    });
  }
  return result;
}

}  // namespace rnndrop
