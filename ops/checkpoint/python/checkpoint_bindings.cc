// memlean._C: the checkpoint of //ops/checkpoint run with a Python function
// (memlean.checkpoint is a thin layer over _C.checkpoint: one implementation for C++ and
// Python), the segment planner (memlean.plan_segments), the segment-argument checks of
// checkpoint_sequential and its loop, the recompute flag (memlean.is_recomputing) and the
// layer-cost measurement (memlean.measure_layer_costs): one specification for both languages.
#include "ops/checkpoint/python/checkpoint_bindings.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops/checkpoint/checkpoint.h"
#include "ops/checkpoint/internal/checkpoint.h"
#include "ops/checkpoint/lean_batchnorm.h"
#include "ops/checkpoint/lean_conv.h"
#include "ops/checkpoint/sequential.h"
#include "ops/checkpoint/sliced_mlp.h"

namespace memlean::python {
namespace {

std::vector<LayerCost> to_costs(const std::vector<int64_t>& input_bytes,
                                const std::vector<int64_t>& activation_bytes) {
  TORCH_CHECK(input_bytes.size() == activation_bytes.size(), "memlean: input_bytes has ",
              input_bytes.size(), " layers but activation_bytes has ", activation_bytes.size());
  std::vector<LayerCost> costs(input_bytes.size());
  for (size_t i = 0; i < costs.size(); ++i) costs[i] = {input_bytes[i], activation_bytes[i]};
  return costs;
}

namespace py = pybind11;

// A Python object that C++ owns and may drop on a thread that does not hold the GIL (the
// autograd engine frees a node's state wherever the graph is freed).
std::shared_ptr<py::object> hold(py::object object) {
  return std::shared_ptr<py::object>(new py::object(std::move(object)), [](py::object* p) {
    if (!Py_IsInitialized()) {
      p->release();  // the interpreter is gone: nothing left to decrement
    } else {
      py::gil_scoped_acquire gil;
      p->dec_ref();
      p->release();
    }
    delete p;
  });
}

// Runs f (which calls Python); a Python exception crosses the C++ frames (and the autograd
// engine's threads) as itself (torch's python_error), not as a C++ error.
template <typename F>
auto keeping_python_errors(F&& f) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    e.restore();
    throw python_error();
  }
}

// The Python segment as a memlean::IValueFunction: `run` is called with a list holding the
// input tensors in their slots (None elsewhere) and returns a list of tensors. Its Python
// exceptions cross the C++ frames (and the autograd engine's threads) as themselves.
IValueFunction python_function(const std::shared_ptr<py::object>& run) {
  return [run](const std::vector<c10::IValue>& in) {
    py::gil_scoped_acquire gil;
    return keeping_python_errors([&] {
      py::list args(in.size());
      for (size_t i = 0; i < in.size(); ++i) {
        // (Every item is set: a new list holds NULLs.)
        args[i] = in[i].isTensor()
                      ? py::reinterpret_steal<py::object>(THPVariable_Wrap(in[i].toTensor()))
                      : py::none();
      }
      py::object result = (*run)(args);
      std::vector<c10::IValue> out;
      for (py::handle h : result) {
        TORCH_INTERNAL_ASSERT(THPVariable_Check(h.ptr()), "memlean._C.checkpoint: the segment "
                              "returned a ", Py_TYPE(h.ptr())->tp_name, ", not a tensor");
        out.emplace_back(THPVariable_Unpack(h.ptr()));
      }
      return out;
    });
  };
}

// A Python chain's layers as a detail::ChainLayer: run(i, h) runs layer i on h and returns a
// tensor (the Python side raises the TypeError for anything else). Called from the autograd
// engine's threads too (the recompute), so it takes the GIL.
detail::ChainLayer python_layer(const std::shared_ptr<py::object>& run, const char* op) {
  return [run, op](int64_t i, const at::Tensor& h) {
    py::gil_scoped_acquire gil;
    return keeping_python_errors([&] {
      py::object out = (*run)(i, py::reinterpret_steal<py::object>(THPVariable_Wrap(h)));
      TORCH_INTERNAL_ASSERT(THPVariable_Check(out.ptr()), op, ": layer ", i, " returned a ",
                            Py_TYPE(out.ptr())->tp_name);
      return THPVariable_Unpack(out.ptr());
    });
  };
}

}  // namespace

void init_checkpoint(pybind11::module_& m) {
  // The lean BatchNorm (lean_batchnorm.h) behind memlean.batchnorm.lean_batch_norm.
  m.def("lean_batch_norm", torch::wrap_pybind_function(&memlean::lean_batch_norm),
        py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("running_mean"),
        py::arg("running_var"), py::arg("momentum"), py::arg("eps"));
  m.def("lean_batch_norm_applies", &memlean::lean_batch_norm_applies, py::arg("input"));
  // The lean depthwise convolution (lean_conv.h) behind memlean.conv2d.
  m.def("lean_conv2d", torch::wrap_pybind_function(&memlean::lean_conv2d), py::arg("input"),
        py::arg("weight"), py::arg("bias"), py::arg("stride"), py::arg("padding"),
        py::arg("dilation"), py::arg("groups"));
  m.def("lean_conv2d_applies", &memlean::lean_conv2d_applies, py::arg("input"),
        py::arg("weight"), py::arg("groups"));
  // memlean.sliced_mlp's and memlean.sliced_gated_mlp's core (sliced_mlp.h): `act` a Python
  // callable run on each slice of the hidden features (None: no activation), called from the
  // autograd engine's threads too (the recompute), so it takes the GIL; gated with wu None:
  // gate and up packed in wg.
  m.def(
      "sliced_mlp",
      [](const at::Tensor& x, const at::Tensor& wg, const std::optional<at::Tensor>& bg,
         const py::object& act, const std::optional<at::Tensor>& wu,
         const std::optional<at::Tensor>& bu, const at::Tensor& wd,
         const std::optional<at::Tensor>& bd, bool gated, bool gate_first, int64_t slices,
         bool act_writes_input, int64_t slice_bytes) {
        SliceActivation activation;
        if (!act.is_none()) {
          activation = [run = hold(act)](const at::Tensor& h) {
            py::gil_scoped_acquire gil;
            return keeping_python_errors([&] {
              py::object out = (*run)(py::reinterpret_steal<py::object>(THPVariable_Wrap(h)));
              TORCH_CHECK_TYPE(THPVariable_Check(out.ptr()), "memlean.sliced_mlp: the ",
                               "activation returned a ", Py_TYPE(out.ptr())->tp_name,
                               ", not a tensor");
              return THPVariable_Unpack(out.ptr());
            });
          };
        }
        SlicedMlpOptions options;
        options.slices = slices;
        options.act_writes_input = act_writes_input;
        options.slice_bytes = slice_bytes;
        py::gil_scoped_release no_gil;
        if (!gated) return memlean::sliced_mlp(x, wg, bg, activation, wd, bd, options);
        return memlean::sliced_gated_mlp(x, wg, bg, activation, wu.value_or(at::Tensor()), bu,
                                         wd, bd, gate_first, options);
      },
      py::arg("x"), py::arg("wg"), py::arg("bg"), py::arg("act"), py::arg("wu"), py::arg("bu"),
      py::arg("wd"), py::arg("bd"), py::arg("gated"), py::arg("gate_first"), py::arg("slices"),
      py::arg("act_writes_input"), py::arg("slice_bytes"));
  // Where memlean::sliced_mlp runs sliced (memlean.sliced.applies asks it for MLPs).
  m.def("sliced_mlp_applies", &memlean::sliced_mlp_applies, py::arg("x"));
  // The one slice-count rule (sliced_mlp.h): memlean.sliced_chain counts with it too.
  m.def("sliced_mlp_slices", &memlean::sliced_mlp_slices, py::arg("hidden_bytes"),
        py::arg("features"), py::arg("slice_bytes"));
  // memlean::unversioned_changes (checkpoint.h): which buffers run() changed unseen by a
  // checkpoint (through .data), one flag each; memlean.fit's check, as memlean::fit's.
  m.def(
      "unversioned_changes",
      [](const std::vector<at::Tensor>& buffers, const py::function& run) {
        return memlean::unversioned_changes(buffers, [&run] { run(); });
      },
      py::arg("buffers"), py::arg("run"));
  // memlean::detail::same_values: whether a buffer still holds its copy's values (how every
  // form of memlean.checkpoint sees a change made through .data: changed_since).
  m.def("same_values", &memlean::detail::same_values, py::arg("now"), py::arg("then"));
  // memlean.checkpoint's core: memlean::checkpoint (detail::checkpoint_impl) running the
  // Python callable `run` (see python_function), named `name` in errors, with `buffers`
  // put back after the recompute; `run.backward_in_full` is read after the forward (FSDP2).
  // Returns the function's output tensors, hanging from the checkpoint's node.
  m.def(
      "checkpoint",
      torch::wrap_pybind_function([](py::object run, const py::sequence& inputs,
                                     const std::vector<at::Tensor>& params,
                                     bool preserve_rng_state, std::vector<at::Tensor> buffers,
                                     std::string name, std::string how_to_list,
                                     std::vector<at::Tensor> rewound) {
        std::vector<c10::IValue> args;
        args.reserve(inputs.size() + params.size());
        for (py::handle h : inputs) {
          args.push_back(THPVariable_Check(h.ptr()) ? c10::IValue(THPVariable_Unpack(h.ptr()))
                                                     : c10::IValue());
        }
        const auto n_inputs = static_cast<int64_t>(args.size());
        args.insert(args.end(), params.begin(), params.end());
        const std::shared_ptr<py::object> held = hold(std::move(run));
        detail::Segment segment;
        segment.function = python_function(held);
        segment.buffers = std::move(buffers);
        segment.rewound = std::move(rewound);
        segment.name = std::move(name);
        segment.how_to_list = std::move(how_to_list);
        segment.backward_in_full = [held] {
          py::gil_scoped_acquire gil;
          return held->attr("backward_in_full").cast<bool>();
        };
        std::vector<c10::IValue> outputs = detail::checkpoint_impl(
            std::move(segment), n_inputs, args, CheckpointOptions().preserve_rng_state(preserve_rng_state));
        std::vector<at::Tensor> tensors;
        tensors.reserve(outputs.size());
        for (auto& v : outputs) tensors.push_back(std::move(v).toTensor());
        return tensors;
      }),
      py::arg("run"), py::arg("inputs"), py::arg("params"), py::arg("preserve_rng_state"),
      py::arg("buffers"), py::arg("name"), py::arg("how_to_list"), py::arg("rewound"),
      "memlean::checkpoint of a Python segment: memlean.checkpoint's core (private).");
  // memlean.measure_layer_costs's core: memlean::measure_layer_costs's measurement
  // (detail::measure_chain_costs) over a Python chain: run(i, h) runs layer i on h and
  // returns a tensor (it raises the TypeError for anything else). Returns
  // [(input_bytes, activation_bytes)] per layer.
  m.def(
      "measure_layer_costs",
      torch::wrap_pybind_function([](py::object run, int64_t n_layers,
                                     const std::vector<at::Tensor>& buffers,
                                     const at::Tensor& sample, const std::string& op) {
        const detail::ChainLayer layer =
            python_layer(hold(std::move(run)), "memlean._C.measure_layer_costs");
        std::vector<std::pair<int64_t, int64_t>> costs;
        for (const LayerCost& c : detail::measure_chain_costs(n_layers, layer, buffers, sample, op.c_str())) {
          costs.emplace_back(c.input_bytes, c.activation_bytes);
        }
        return costs;
      }),
      py::arg("run"), py::arg("n_layers"), py::arg("buffers"), py::arg("sample"), py::arg("op"),
      "memlean::measure_layer_costs over Python layers: memlean.measure_layer_costs's core (private).");
  // memlean.checkpoint_sequential's core: memlean::checkpoint_sequential's loop
  // (detail::checkpoint_chain) over a Python chain: run(i, h) runs layer i (see
  // python_layer); parameters[i] and buffers[i] are layer i's; run.backward_in_full(begin,
  // end) is asked after a segment's forward (FSDP2). Errors name `name`.
  m.def(
      "checkpoint_sequential",
      torch::wrap_pybind_function([](py::object run,
                                     std::vector<std::vector<at::Tensor>> parameters,
                                     std::vector<std::vector<at::Tensor>> buffers,
                                     const std::vector<int64_t>& starts, const at::Tensor& input,
                                     bool preserve_rng_state, std::string name,
                                     std::string how_to_list,
                                     std::vector<std::vector<at::Tensor>> rewound) {
        const std::shared_ptr<py::object> held = hold(std::move(run));
        auto chain = std::make_shared<detail::Chain>();
        chain->layer = python_layer(held, "memlean._C.checkpoint_sequential");
        chain->parameters = std::move(parameters);
        chain->buffers = std::move(buffers);
        TORCH_CHECK(rewound.empty() || rewound.size() == chain->buffers.size(),
                    "memlean._C.checkpoint_sequential: ", rewound.size(), " rewound lists for ",
                    chain->buffers.size(), " layers");
        chain->rewound = std::move(rewound);
        chain->name = std::move(name);
        chain->how_to_list = std::move(how_to_list);
        chain->backward_in_full = [held](int64_t begin, int64_t end) {
          py::gil_scoped_acquire gil;
          return held->attr("backward_in_full")(begin, end).cast<bool>();
        };
        return detail::checkpoint_chain(chain, starts, input,
                                        CheckpointOptions().preserve_rng_state(preserve_rng_state));
      }),
      py::arg("run"), py::arg("parameters"), py::arg("buffers"), py::arg("starts"),
      py::arg("input"), py::arg("preserve_rng_state"), py::arg("name"), py::arg("how_to_list"),
      py::arg("rewound"),
      "memlean::checkpoint_sequential's loop over Python layers: "
      "memlean.checkpoint_sequential's core (private).");
  m.def(
      "plan_segments",
      [](const std::vector<int64_t>& input_bytes, const std::vector<int64_t>& activation_bytes,
         std::optional<int64_t> budget_bytes) {
        const SegmentPlan plan = plan_segments(to_costs(input_bytes, activation_bytes), budget_bytes);
        return py::make_tuple(plan.starts, plan.estimated_peak_bytes, plan.fits_budget);
      },
      py::arg("input_bytes"), py::arg("activation_bytes"), py::arg("budget_bytes") = py::none(),
      "memlean::plan_segments: (starts, estimated_peak_bytes, fits_budget).");
  m.def("sqrt_segment_starts", &sqrt_segment_starts, py::arg("n_layers"),
        "round(sqrt(n)) (nearly) equal segments over n layers.");
  // The argument checks of checkpoint_sequential, shared with memlean.checkpoint_sequential
  // (ValueErrors naming `op`).
  m.def("equal_segment_starts",
        torch::wrap_pybind_function([](int64_t n_layers, int64_t segments, const std::string& op) {
          return equal_segment_starts(n_layers, segments, op.c_str());
        }),
        py::arg("n_layers"), py::arg("segments"), py::arg("op"),
        "memlean::equal_segment_starts: `segments` (nearly) equal segments over n layers.");
  m.def("check_segment_starts",
        torch::wrap_pybind_function(
            [](const std::vector<int64_t>& starts, int64_t n_layers, const std::string& op) {
              check_segment_starts(starts, n_layers, op.c_str());
            }),
        py::arg("starts"), py::arg("n_layers"), py::arg("op"),
        "memlean::check_segment_starts: 0 first, increasing, < n_layers.");
  m.def("is_recomputing", &is_recomputing,
        "memlean::is_recomputing: a checkpoint (C++ or Python) recomputes on this thread.");
}

}  // namespace memlean::python
