// The Python module of the compiled loop kernels (built by rnndrop/kernels/compiled.py): the
// functions and structs of kernels.h, every field bound under its own C++ name (FIELD).
#include <torch/extension.h>

#include <atomic>

#include "kernels.h"

namespace rnndrop {

// How many threads one of this library's parallel loops runs on (at::parallel_for is compiled
// here: without OpenMP in the build it runs on one, whatever torch.get_num_threads() says).
int64_t parallel_threads() {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
  return seen.load();
}

}  // namespace rnndrop

namespace {

namespace py = pybind11;

// A struct of kernels.h as a Python class: made empty, its fields then set and read by name.
template <typename T>
py::class_<T> bind_struct(py::module_& m, const char* name, const char* doc) {
  return py::class_<T>(m, name, doc).def(py::init<>());
}

}  // namespace

#define FIELD(Struct, name) def_readwrite(#name, &Struct::name)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace rnndrop;
  m.doc() = "rnndrop's LSTM and GRU recurrences with their time loops in C++ (declared in csrc/kernels.h)";

  bind_struct<Schedule>(m, "Schedule", "the order of a call's steps over the packed rows")
      .FIELD(Schedule, batch_sizes).FIELD(Schedule, reverse);

  bind_struct<LSTMInputs>(m, "LSTMInputs", "the inputs of an LSTM recurrence")
      .FIELD(LSTMInputs, gates_x).FIELD(LSTMInputs, h0).FIELD(LSTMInputs, c0).FIELD(LSTMInputs, w_hh)
      .FIELD(LSTMInputs, w_hr).FIELD(LSTMInputs, mask);
  bind_struct<LSTMNeeds>(m, "LSTMNeeds", "which of an LSTM recurrence's inputs want a gradient")
      .FIELD(LSTMNeeds, gates_x).FIELD(LSTMNeeds, h0).FIELD(LSTMNeeds, c0).FIELD(LSTMNeeds, w_hh)
      .FIELD(LSTMNeeds, w_hr).FIELD(LSTMNeeds, mask);
  bind_struct<LSTMGrads>(m, "LSTMGrads", "the gradients of an LSTM recurrence's inputs (None: not wanted)")
      .FIELD(LSTMGrads, gates_x).FIELD(LSTMGrads, h0).FIELD(LSTMGrads, c0).FIELD(LSTMGrads, w_hh)
      .FIELD(LSTMGrads, w_hr).FIELD(LSTMGrads, mask);
  bind_struct<LSTMForward>(m, "LSTMForward", "an LSTM forward pass's outputs and buffers")
      .FIELD(LSTMForward, out).FIELD(LSTMForward, h_n).FIELD(LSTMForward, c_n).FIELD(LSTMForward, acts)
      .FIELD(LSTMForward, cells).FIELD(LSTMForward, tanh_cells).FIELD(LSTMForward, r).FIELD(LSTMForward, masked);
  bind_struct<LSTMSaved>(m, "LSTMSaved", "what the LSTM's backward pass reads")
      .FIELD(LSTMSaved, acts).FIELD(LSTMSaved, cells).FIELD(LSTMSaved, tanh_cells).FIELD(LSTMSaved, out)
      .FIELD(LSTMSaved, r).FIELD(LSTMSaved, masked).FIELD(LSTMSaved, h0).FIELD(LSTMSaved, c0)
      .FIELD(LSTMSaved, w_hh).FIELD(LSTMSaved, w_hr).FIELD(LSTMSaved, mask);
  bind_struct<LSTMOutputGrads>(m, "LSTMOutputGrads", "the gradients of an LSTM recurrence's outputs")
      .FIELD(LSTMOutputGrads, out).FIELD(LSTMOutputGrads, h_n).FIELD(LSTMOutputGrads, c_n);
  m.def("lstm_forward", &lstm_forward, py::arg("inputs"), py::arg("schedule"), py::arg("w_packed"),
        py::arg("keep"), py::arg("parts"),
        "LSTMForward of one layer and direction (keep false, for inference: buffers of the last step only; "
        "parts > 0: the step split by hidden units, one part a thread)");
  m.def("lstm_backward", &lstm_backward, py::arg("grads"), py::arg("saved"), py::arg("schedule"),
        py::arg("needs"), py::arg("w_t_packed"), py::arg("onednn_weight_grad"),
        "LSTMGrads of the inputs that need them (dW_hh through oneDNN where onednn_weight_grad)");

  bind_struct<GRUInputs>(m, "GRUInputs", "the inputs of a GRU recurrence")
      .FIELD(GRUInputs, gates_x).FIELD(GRUInputs, h0).FIELD(GRUInputs, w_hh).FIELD(GRUInputs, b_hh)
      .FIELD(GRUInputs, mask);
  bind_struct<GRUNeeds>(m, "GRUNeeds", "which of a GRU recurrence's inputs want a gradient")
      .FIELD(GRUNeeds, gates_x).FIELD(GRUNeeds, h0).FIELD(GRUNeeds, w_hh).FIELD(GRUNeeds, b_hh)
      .FIELD(GRUNeeds, mask);
  bind_struct<GRUGrads>(m, "GRUGrads", "the gradients of a GRU recurrence's inputs (None: not wanted)")
      .FIELD(GRUGrads, gates_x).FIELD(GRUGrads, h0).FIELD(GRUGrads, w_hh).FIELD(GRUGrads, b_hh)
      .FIELD(GRUGrads, mask);
  bind_struct<GRUForward>(m, "GRUForward", "a GRU forward pass's outputs and buffers")
      .FIELD(GRUForward, out).FIELD(GRUForward, h_n).FIELD(GRUForward, acts).FIELD(GRUForward, a_n)
      .FIELD(GRUForward, masked);
  bind_struct<GRUSaved>(m, "GRUSaved", "what the GRU's backward pass reads")
      .FIELD(GRUSaved, acts).FIELD(GRUSaved, a_n).FIELD(GRUSaved, out).FIELD(GRUSaved, masked)
      .FIELD(GRUSaved, h0).FIELD(GRUSaved, w_hh).FIELD(GRUSaved, mask);
  bind_struct<GRUOutputGrads>(m, "GRUOutputGrads", "the gradients of a GRU recurrence's outputs")
      .FIELD(GRUOutputGrads, out).FIELD(GRUOutputGrads, h_n);
  m.def("gru_forward", &gru_forward, py::arg("inputs"), py::arg("schedule"), py::arg("w_packed"),
        py::arg("keep"), "GRUForward of one layer and direction (keep false: buffers of the last step only)");
  m.def("gru_backward", &gru_backward, py::arg("grads"), py::arg("saved"), py::arg("schedule"),
        py::arg("needs"), py::arg("w_t_packed"), py::arg("onednn_weight_grad"),
        "GRUGrads of the inputs that need them (dW_hh through oneDNN where onednn_weight_grad)");

  m.def("parallel_threads", &parallel_threads, "how many threads one of the library's parallel loops runs on");
}
