// The boundary between rnndrop/kernels/compiled.py and the C++ loops: every function the
// module exports and every value it passes, by name. Each call takes structs whose fields are
// set by name from Python (module.cpp binds each field under its own C++ name), so reordering
// a struct's fields, or a function's parameters of different types, cannot pair a tensor with
// the wrong argument: a field the Python side does not set, or sets under another name, is an
// error there, not a silent wrong gradient.
//
// Shapes: N = sum(batch_sizes) rows in packed, time-major order; B = batch_sizes[0]; H hidden
// units; P = proj_size or H; G gates (LSTM 4, GRU 3). The hidden mask is [T', B', P] or, per
// gate, [T', B', G, P] with T' in {1, T} and B' in {1, B}; the masked states ("masked") are
// those masks times h_{t-1}: [rows, P], per gate gate-major [G, rows, P].
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <vector>

namespace rnndrop {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

// The order of a call's steps over the packed rows.
struct Schedule {
  std::vector<int64_t> batch_sizes;  // rows of each step, non-increasing
  bool reverse = false;              // the steps from last to first
};

// ------------------------------------------------------------------------------------- LSTM

// The inputs of one layer and direction's LSTM recurrence.
struct LSTMInputs {
  Tensor gates_x;  // [N, 4H]: x W_ihᵀ + b_ih + b_hh of every row
  Tensor h0;       // [B, P]
  Tensor c0;       // [B, H]
  Tensor w_hh;     // [4H, P]
  OptTensor w_hr;  // [P, H], the projection
  OptTensor mask;  // the hidden mask
};

// For each differentiable input of the LSTM recurrence, a T: whether its gradient is wanted
// (bool), or the gradient (OptTensor, empty where not wanted).
template <typename T>
struct LSTMEach {
  T gates_x, h0, c0, w_hh, w_hr, mask;
};
using LSTMNeeds = LSTMEach<bool>;
using LSTMGrads = LSTMEach<OptTensor>;

// What an LSTM forward pass computes: the outputs, and the buffers a backward pass reads (with
// keep false, for inference, acts / cells / tanh_cells / r hold one step's rows only).
struct LSTMForward {
  Tensor out;         // [N, P]: h_t of every row
  Tensor h_n;         // [B, P]
  Tensor c_n;         // [B, H]
  Tensor acts;        // [N, 4H]: the gates i, f, g, o after their nonlinearities
  Tensor cells;       // [N, H]: c_t
  Tensor tanh_cells;  // [N, H]: tanh(c_t)
  OptTensor r;        // [N, H]: o * tanh(c_t) before the projection (with a projection only)
  OptTensor masked;   // masked states of every row (shared masks only: per-gate ones are rebuilt)
};

// What the LSTM's backward pass reads: the forward's buffers and output, and its inputs.
struct LSTMSaved {
  Tensor acts, cells, tanh_cells, out;
  OptTensor r, masked;
  Tensor h0, c0, w_hh;
  OptTensor w_hr, mask;
};

// The gradients flowing into an LSTM recurrence's outputs (empty: zero).
struct LSTMOutputGrads {
  OptTensor out, h_n, c_n;
};

// parts > 0: the forward step split by hidden units, one part a thread (compiled.split_parts).
LSTMForward lstm_forward(const LSTMInputs& inputs, const Schedule& schedule, const std::vector<Tensor>& w_packed,
                         bool keep, int64_t parts);
// onednn_weight_grad: dW_hh through oneDNN (float32, where the Python side found it faster), else BLAS.
LSTMGrads lstm_backward(const LSTMOutputGrads& grads, const LSTMSaved& saved, const Schedule& schedule,
                        const LSTMNeeds& needs, const std::vector<Tensor>& w_t_packed, bool onednn_weight_grad);

// -------------------------------------------------------------------------------------- GRU

// The inputs of one layer and direction's GRU recurrence.
struct GRUInputs {
  Tensor gates_x;  // [N, 3H]: x W_ihᵀ + b_ih of every row
  Tensor h0;       // [B, H]
  Tensor w_hh;     // [3H, H]
  OptTensor b_hh;  // [3H]
  OptTensor mask;  // the hidden mask
};

// For each differentiable input of the GRU recurrence, a T (see LSTMEach).
template <typename T>
struct GRUEach {
  T gates_x, h0, w_hh, b_hh, mask;
};
using GRUNeeds = GRUEach<bool>;
using GRUGrads = GRUEach<OptTensor>;

// What a GRU forward pass computes (with keep false, acts / a_n / masked hold one step's rows).
struct GRUForward {
  Tensor out;        // [N, H]: h_t of every row
  Tensor h_n;        // [B, H]
  Tensor acts;       // [N, 3H]: r, z, n
  Tensor a_n;        // [N, H]: the n gate's recurrent term W_hn m + b_hn
  OptTensor masked;  // masked states (with a mask only)
};

// What the GRU's backward pass reads: the forward's buffers and output, and its inputs.
struct GRUSaved {
  Tensor acts, a_n, out;
  OptTensor masked;
  Tensor h0, w_hh;
  OptTensor mask;
};

// The gradients flowing into a GRU recurrence's outputs (empty: zero).
struct GRUOutputGrads {
  OptTensor out, h_n;
};

GRUForward gru_forward(const GRUInputs& inputs, const Schedule& schedule, const std::vector<Tensor>& w_packed,
                       bool keep);
GRUGrads gru_backward(const GRUOutputGrads& grads, const GRUSaved& saved, const Schedule& schedule,
                      const GRUNeeds& needs, const std::vector<Tensor>& w_t_packed, bool onednn_weight_grad);

// How many threads one of this library's parallel loops runs on.
int64_t parallel_threads();

}  // namespace rnndrop
