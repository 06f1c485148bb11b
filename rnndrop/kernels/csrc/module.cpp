// The Python module of the compiled loop kernels (built by rnndrop/kernels/compiled.py).
#include <torch/extension.h>

#include <atomic>
#include <vector>

namespace rnndrop {
using at::Tensor;
using OptTensor = c10::optional<Tensor>;
using Sizes = std::vector<int64_t>;
using Tensors = std::vector<Tensor>;

std::vector<Tensor> lstm_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                 const OptTensor&, const Sizes&, bool, const Tensors&, bool, int64_t);
std::vector<Tensor> lstm_backward(const OptTensor&, const OptTensor&, const OptTensor&, const Tensor&,
                                  const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                  const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                  const Sizes&, bool, std::vector<bool>, const Tensors&);
std::vector<Tensor> gru_forward(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                const Sizes&, bool, const Tensors&, bool);
std::vector<Tensor> gru_backward(const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const OptTensor&, const Tensor&, const Tensor&, const OptTensor&, const Sizes&,
                                 bool, std::vector<bool>, const Tensors&);

// How many threads one of this library's parallel loops runs on (at::parallel_for is compiled
// here: without OpenMP in the build it runs on one, whatever torch.get_num_threads() says).
int64_t parallel_threads() {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
  return seen.load();
}
}  // namespace rnndrop

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rnndrop's LSTM and GRU recurrences with their time loops in C++";
  m.def("lstm_forward", &rnndrop::lstm_forward,
        "(gates_x, h0, c0, w_hh, w_hr, mask, batch_sizes, reverse, w_packed, keep, parts) -> "
        "[out, h_n, c_n, acts, cells, tanh_cells, r, masked] (keep false: for inference, the last four "
        "hold the last step's rows only; parts > 0: the step split by hidden units, one part a thread)");
  m.def("lstm_backward", &rnndrop::lstm_backward,
        "(d_out, d_hn, d_cn, acts, cells, tanh_cells, out, r, masked, h0, c0, w_hh, w_hr, mask, batch_sizes, "
        "reverse, needs, w_t_packed) -> [d_gates_x, d_h0, d_c0, d_w_hh, d_w_hr, d_mask]");
  m.def("parallel_threads", &rnndrop::parallel_threads,
        "() -> how many threads one of the library's parallel loops runs on");
  m.def("gru_forward", &rnndrop::gru_forward,
        "(gates_x, h0, w_hh, b_hh, mask, batch_sizes, reverse, w_packed, keep) -> [out, h_n, acts, a_n, masked] "
        "(keep false: for inference, the last three hold the last step's rows only)");
  m.def("gru_backward", &rnndrop::gru_backward,
        "(d_out, d_hn, acts, a_n, out, masked, h0, w_hh, mask, batch_sizes, reverse, needs, w_t_packed) -> "
        "[d_gates_x, d_h0, d_w_hh, d_b_hh, d_mask]");
}
