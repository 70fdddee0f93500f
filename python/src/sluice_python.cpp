// sluice._C: the Python face of the public C++ API (sluice/sluice.hpp). Tensors cross as
// torch tensors (zero-copy, through torch's own pybind11 casters), sluice exceptions become
// Python exceptions with the same one-line messages, and the GIL is released for the
// duration of every call that can take long (load, lock, forward, encode_text, residency
// changes), so other Python threads run meanwhile. The Pythonic layer (context managers,
// dict stats) is in sluice/__init__.py.
#include <torch/csrc/utils/pybind.h>

#include <c10/util/Exception.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "runtime/error.h"
#include "runtime/size_parse.h"
#include "sluice/inspect.hpp"
#include "sluice/offload.hpp"
#include "sluice/sluice.hpp"

namespace py = pybind11;

namespace {

using release_gil = py::call_guard<py::gil_scoped_release>;

// Note [log sink]
// ~~~~~~~~~~~~~~~
// sluice's log lines go to Python's logging (the `sluice` logger: sluice/_logging.py). They
// are written on any thread: a copy worker's, or a forward's that runs with the GIL let go
// while the main thread waits for it. A sink that took the GIL there could wait for a
// thread that waits for sluice: a deadlock. So the sink never touches Python: it queues the
// line (at most kLogQueued; past that lines are counted and dropped), and Python takes the
// lines off the queue (_log_next) on a thread of its own, and after each offloaded forward.
// _log_next never waits and never lets the GIL go: a daemon thread that took the GIL back
// in C++ during interpreter shutdown would be ended by pthread_exit through a noexcept
// destructor (std::terminate); the Python thread sleeps in Python between polls instead.
struct LogQueue {
  static constexpr size_t kLogQueued = 10000;
  std::mutex mutex;
  std::deque<std::pair<int, std::string>> lines;
  uint64_t dropped = 0;
};

LogQueue& log_queue() {
  static LogQueue* q = new LogQueue;  // never freed: a copy worker may log during interpreter shutdown
  return *q;
}

// Note [Ctrl-C in a forward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A forward runs with the GIL released, and Python runs signal handlers only on the main
// thread, between bytecodes: a Ctrl-C would be seen only once the forward returned (7.6 s
// in issue 29). So a forward called on the main thread checks for signals between layers:
// after each layer (LockedModel::LayerProgress) it takes the GIL briefly and calls
// PyErr_CheckSignals(). When a handler raised (SIGINT's default handler raises
// KeyboardInterrupt), that Python error travels as a PythonInterrupt, a sluice::Interrupted:
// the forward ends before its next layer and unwinds as from any error (leases released,
// weights in their storage dtype), and the binding raises the Python error again. A
// KeyboardInterrupt (or another BaseException that is not an Exception, SystemExit) raised
// inside the caller's own progress callback stops the forward the same way; an Exception
// there is logged once and the callback dropped, as before. The cost is one uncontended GIL
// acquisition per layer (about a microsecond); a forward on another thread, where no
// handler could run, does not check. encode_text and locate_nonfinite do not check.
unsigned long main_thread_ident = 0;  // threading.main_thread().ident, set when the module loads

struct PythonInterrupt : sluice::Interrupted {
  // GIL held: what() of the Python error is read here.
  explicit PythonInterrupt(py::error_already_set e)
      : sluice::Interrupted(std::string("forward interrupted: ") + e.what()), error(std::move(e)) {}
  py::error_already_set error;  // its copies and destruction take the GIL themselves
};

// LockedModel::locate_nonfinite's finding as a dict, or None (GIL held).
py::object nonfinite_dict(const std::optional<sluice::NonFiniteReport>& r) {
  if (!r) return py::none();
  py::dict d;
  d["kind"] = r->kind;
  d["module"] = r->module;
  d["nonfinite_values"] = r->nonfinite_values;
  d["values"] = r->values;
  d["output_nonfinite_values"] = r->output_nonfinite_values;
  d["output_values"] = r->output_values;
  d["forward_index"] = r->forward_index;
  return std::move(d);
}

// A prefetch option as Python gives it: "auto" or a number of layers (an int or its string).
std::string prefetch_option(const py::object& prefetch) {
  return py::isinstance<py::int_>(prefetch) ? std::to_string(prefetch.cast<int64_t>()) : prefetch.cast<std::string>();
}

sluice::RuntimeOptions runtime_options(const std::string& device, const std::string& vram_budget,
                                       const std::string& working_memory, int64_t resolution, const std::string& ram_limit,
                                       const py::object& prefetch, const std::string& pin_memory, const std::string& pin_memory_limit,
                                       const std::string& policy, bool timing, bool trace, uint64_t device_memory,
                                       double cpu_copy_gbps, const std::string& vram_headroom, int load_threads) {
  sluice::RuntimeOptions o;
  o.device = device;
  o.vram_budget = vram_budget;
  o.working_memory = working_memory;
  o.resolution = resolution;
  o.ram_limit = ram_limit;
  o.prefetch = prefetch_option(prefetch);
  o.pin_memory = pin_memory;
  o.pin_memory_limit = pin_memory_limit;
  o.policy = policy;
  o.timing = timing;
  o.trace = trace;
  o.device_memory = device_memory;
  o.cpu_copy_gbps = cpu_copy_gbps;
  o.vram_headroom = vram_headroom;
  o.load_threads = load_threads;
  return o;
}

sluice::LoadOptions load_options(const std::string& storage, const std::string& compute,
                                 const std::vector<std::string>& extra_skips, bool use_default_skips, bool use_model_skips,
                                 std::optional<double> max_resident, const std::string& config, uint64_t seed,
                                 const std::string& name) {
  sluice::LoadOptions o;
  o.storage = storage;
  o.compute = compute;
  o.extra_skips = extra_skips;
  o.use_default_skips = use_default_skips;
  o.use_model_skips = use_model_skips;
  o.max_resident = max_resident;
  o.config = config;
  o.seed = seed;
  o.name = name;
  return o;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "sluice: run large diffusion transformers on GPUs too small to hold them";
  main_thread_ident = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();

  // pybind11 tries translators newest first, so the base class is registered first.
  auto& error = py::register_exception<sluice::Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<sluice::FileError>(m, "FileError", error.ptr());
  py::register_exception<sluice::CheckpointError>(m, "CheckpointError", error.ptr());
  py::register_exception<sluice::ResourceError>(m, "ResourceError", error.ptr());
  // A bad argument is a ValueError too, as Python's own are: PyErr_NewException (which
  // pybind11's exception<T> calls with `base`) takes a tuple of bases.
  py::register_exception<sluice::InvalidArgument>(m, "InvalidArgument",
                                                   py::make_tuple(error, py::handle(PyExc_ValueError)));
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::Error& e) {
      // torch's checks inside an op: a bad input, reported without the C++ backtrace.
      const py::object type = py::module_::import("sluice._C").attr("InvalidArgument");
      PyErr_SetString(type.ptr(), e.what_without_backtrace());
    }
  });

  m.def("version", &sluice::version);
  // A size the C++ side takes as a number (sluice/_arguments.py size_bytes): "8GiB" as sluice
  // reads every size (Note [size suffixes]); no percentages. InvalidArgument naming `name`.
  m.def(
      "_parse_size",
      [](const std::string& text, const std::string& name) { return sluice::parse_size(text, std::nullopt, name); },
      py::arg("text"), py::arg("name"));
  // Note [log sink].
  m.def("_log_to_queue", [](bool on) {
    if (!on) {
      sluice::set_log_sink(nullptr);
      return;
    }
    sluice::set_log_sink([](sluice::LogLevel level, const std::string& line) {
      LogQueue& q = log_queue();
      {
        std::lock_guard<std::mutex> lock(q.mutex);
        if (q.lines.size() >= LogQueue::kLogQueued) {
          q.dropped += 1;
          return;
        }
        q.lines.emplace_back(static_cast<int>(level), line);
      }
    });
  });
  m.def("_log_next", []() -> py::object {
        std::optional<std::pair<int, std::string>> line;
        uint64_t dropped = 0;
        {
          LogQueue& q = log_queue();
          std::lock_guard<std::mutex> lock(q.mutex);  // held by a sink for a push only: never long
          if (!q.lines.empty()) {
            line = std::move(q.lines.front());
            q.lines.pop_front();
          }
          dropped = std::exchange(q.dropped, 0);
        }
        if (!line && !dropped) return py::none();
        if (!line) return py::make_tuple(static_cast<int>(sluice::LogLevel::warn),
                                         std::to_string(dropped) + " log lines dropped (the queue was full)");
        return py::make_tuple(line->first, line->second);
      });
  m.def("_set_log_level", [](int level) { sluice::set_log_level(static_cast<sluice::LogLevel>(level)); });
  m.def(
      "inspect_json",
      [](const std::string& source, const std::string& storage) {
        sluice::InspectOptions o;
        o.storage = storage;
        return sluice::inspect(source, o).json;
      },
      py::arg("source"), py::arg("storage") = "", release_gil());

  py::class_<sluice::RuntimeOptions>(m, "RuntimeOptions")
      .def(py::init(&runtime_options), py::arg("device") = "cpu", py::arg("vram_budget") = "",
           py::arg("working_memory") = "", py::arg("resolution") = 1024, py::arg("ram_limit") = "",
           py::arg("prefetch") = "auto", py::arg("pin_memory") = "auto", py::arg("pin_memory_limit") = "",
           py::arg("policy") = "balanced", py::arg("timing") = true, py::arg("trace") = false,
           py::arg("device_memory") = 0, py::arg("cpu_copy_gbps") = 0.0, py::arg("vram_headroom") = "",
           py::arg("load_threads") = 0)
      .def_readonly("device", &sluice::RuntimeOptions::device)
      .def_readonly("vram_budget", &sluice::RuntimeOptions::vram_budget)
      .def_readonly("prefetch", &sluice::RuntimeOptions::prefetch);

  py::class_<sluice::LoadOptions>(m, "LoadOptions")
      .def(py::init(&load_options), py::arg("storage") = "float8_e4m3fn", py::arg("compute") = "auto",
           py::arg("extra_skips") = std::vector<std::string>{}, py::arg("use_default_skips") = true,
           py::arg("use_model_skips") = true, py::arg("max_resident") = std::nullopt, py::arg("config") = "",
           py::arg("seed") = 0, py::arg("name") = "");

  py::class_<sluice::LoraHandle>(m, "LoraHandle")
      .def_property_readonly("patched_layers", &sluice::LoraHandle::patched_layers)
      .def_property_readonly("active", &sluice::LoraHandle::active)
      .def("remove", &sluice::LoraHandle::remove, release_gil());

  py::class_<sluice::LockedModel>(m, "LockedModel")
      .def(
          "forward",
          [](sluice::LockedModel& m, const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context,
             const std::optional<py::function>& progress) {
            // Note [Ctrl-C in a forward]: signals are checked between layers on the main thread.
            const bool check_signals = PyThread_get_thread_ident() == main_thread_ident;
            if (!progress && !check_signals) {
              py::gil_scoped_release release;
              return m.forward(x, timesteps, context);
            }
            // progress(layers_done, layers_expected) after each layer, with the GIL taken for
            // the call only. The function object stays owned here (the GIL is held while it
            // is copied or freed); a Python exception becomes a C++ one before the GIL goes,
            // and sluice logs it and stops calling (LockedModel::forward), unless it is a
            // KeyboardInterrupt or SystemExit, which stops the forward.
            const py::function* fn = progress ? &*progress : nullptr;
            const sluice::LockedModel::LayerProgress call = [fn, check_signals](int64_t done, int64_t expected) {
              py::gil_scoped_acquire gil;
              if (check_signals && PyErr_CheckSignals() != 0) throw PythonInterrupt(py::error_already_set());
              if (fn == nullptr) return;
              try {
                (*fn)(done, expected);
              } catch (py::error_already_set& e) {
                if (!e.matches(PyExc_Exception)) throw PythonInterrupt(std::move(e));
                throw std::runtime_error(e.what());
              }
            };
            try {
              py::gil_scoped_release release;
              return m.forward(x, timesteps, context, call);
            } catch (PythonInterrupt& e) {
              throw e.error;  // the GIL is held again: pybind11 raises it (KeyboardInterrupt)
            }
          },
          py::arg("x"), py::arg("timesteps"), py::arg("context"), py::arg("progress") = py::none())
      .def("encode_text", &sluice::LockedModel::encode_text, py::arg("qwen_hidden"), py::arg("t5_ids"),
           py::arg("t5_weights") = std::nullopt, release_gil())
      .def(
          "locate_nonfinite",
          [](sluice::LockedModel& m, const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context) {
            std::optional<sluice::NonFiniteReport> r;
            {
              py::gil_scoped_release release;
              r = m.locate_nonfinite(x, timesteps, context);
            }
            return nonfinite_dict(r);
          },
          py::arg("x"), py::arg("timesteps"), py::arg("context"))
      .def(
          "locate_nonfinite_text",
          [](sluice::LockedModel& m, const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
             const std::optional<at::Tensor>& t5_weights) {
            std::optional<sluice::NonFiniteReport> r;
            {
              py::gil_scoped_release release;
              r = m.locate_nonfinite_text(qwen_hidden, t5_ids, t5_weights);
            }
            return nonfinite_dict(r);
          },
          py::arg("qwen_hidden"), py::arg("t5_ids"), py::arg("t5_weights") = std::nullopt)
      .def("apply_lora", &sluice::LockedModel::apply_lora, py::arg("path"), py::arg("scale") = 1.0, release_gil())
      .def("unlock", &sluice::LockedModel::unlock, release_gil())
      .def_property_readonly("locked", [](const sluice::LockedModel& l) { return static_cast<bool>(l); })
      .def("info_json", [](const sluice::LockedModel& l) { return l.info().config_json; });

  py::class_<sluice::Model>(m, "Model")
      .def_property_readonly("name", &sluice::Model::name)
      .def("info_json", [](const sluice::Model& mo) { return mo.info().config_json; })
      .def("lock", &sluice::Model::lock, release_gil())
      .def("partial_load", &sluice::Model::partial_load, py::arg("bytes"), release_gil())
      .def("partial_unload", &sluice::Model::partial_unload, py::arg("bytes"), release_gil())
      .def("full_load", &sluice::Model::full_load, release_gil())
      .def("full_unload", &sluice::Model::full_unload, release_gil())
      .def("set_max_resident", &sluice::Model::set_max_resident, py::arg("fraction"), release_gil())
      .def("stats_json", &sluice::Model::stats_json, py::arg("indent") = -1, release_gil())
      .def("write_trace", &sluice::Model::write_trace, py::arg("path"), release_gil())
      .def("residency_map", &sluice::Model::residency_map);

  py::class_<sluice::ModelCache>(m, "ModelCache")
      .def(py::init<sluice::RuntimeOptions>(), py::arg("options"), release_gil())
      .def("load", &sluice::ModelCache::load, py::arg("path_or_preset"), py::arg("options"), release_gil())
      .def("drop", &sluice::ModelCache::drop, py::arg("model"), release_gil())
      .def("set_vram_budget", &sluice::ModelCache::set_vram_budget, py::arg("budget"), release_gil())
      .def("stats_json", &sluice::ModelCache::stats_json, py::arg("indent") = -1, release_gil())
      .def("models", &sluice::ModelCache::models, release_gil());

  // sluice.offload(module) (python/sluice/offload.py) over sluice::OffloadedModel.
  py::class_<sluice::OffloadedModel>(m, "OffloadedModel")
      // `cache`: a ModelCache to go into (then the cache-wide options, None here, are the
      // cache's); None: a cache of its own, from those options (None: their defaults).
      // Built a layer at a time (add_layer, then finish), so that the caller frees each
      // original before it hands over the next.
      .def(py::init([](sluice::ModelCache* cache, const std::string& name, const std::string& storage,
                       const std::string& compute, std::vector<std::string> skip, std::optional<double> max_resident,
                       std::optional<std::string> device, std::optional<std::string> vram_budget,
                       std::optional<std::string> working_memory, std::optional<std::string> pin_memory,
                       const py::object& prefetch, std::optional<bool> trace) {
             sluice::OffloadOptions o;
             o.name = name;
             o.storage = storage;
             o.compute = compute;
             o.skip = std::move(skip);
             o.max_resident = max_resident;
             if (device) o.device = *device;
             if (vram_budget) o.vram_budget = *vram_budget;
             if (working_memory) o.working_memory = *working_memory;
             if (pin_memory) o.pin_memory = *pin_memory;
             if (!prefetch.is_none()) o.prefetch = prefetch_option(prefetch);
             if (trace) o.trace = *trace;
             py::gil_scoped_release nogil;
             return cache ? std::make_unique<sluice::OffloadedModel>(*cache, o)
                          : std::make_unique<sluice::OffloadedModel>(o);
           }),
           py::kw_only(), py::arg("cache") = nullptr, py::arg("name") = "",
           py::arg("storage") = "float8_e4m3fn", py::arg("compute") = "bfloat16",
           py::arg("skip") = std::vector<std::string>{}, py::arg("max_resident") = std::nullopt,
           py::arg("device") = std::nullopt, py::arg("vram_budget") = std::nullopt,
           py::arg("working_memory") = std::nullopt, py::arg("pin_memory") = std::nullopt,
           py::arg("prefetch") = py::none(), py::arg("trace") = std::nullopt,
           py::keep_alive<1, 2>())  // the cache outlives the model (it holds the cache's state too)
      // kind: "linear" | "embedding" | "other"; compute: "" = the model's.
      .def("add_layer",
           [](sluice::OffloadedModel& m, const std::string& lname, const at::Tensor& w, std::optional<at::Tensor> b,
              const std::string& kind, const std::string& compute) {
             sluice::OffloadLayerKind k = sluice::OffloadLayerKind::other;
             if (kind == "linear") {
               k = sluice::OffloadLayerKind::linear;
             } else if (kind == "embedding") {
               k = sluice::OffloadLayerKind::embedding;
             } else if (kind != "other") {
               throw sluice::InvalidArgument("offload: layer '" + lname + "' has kind '" + kind +
                                             "' (linear, embedding or other)");
             }
             sluice::OffloadLayer l{lname, w, std::move(b), k, compute};
             py::gil_scoped_release nogil;
             return m.add_layer(std::move(l));
           },
           py::arg("name"), py::arg("weight"), py::arg("bias"), py::arg("kind") = "linear", py::arg("compute") = "")
      .def("finish", &sluice::OffloadedModel::finish, py::arg("extras"), release_gil())
      .def("release_layer", &sluice::OffloadedModel::release_layer, py::arg("index"), release_gil())
      // fn(weight, bias or None) -> any object, with layer i's weights leased for the call:
      // how a layer runs its own forward (its hooks, a patched forward, a subclass's) in
      // sluice.offload. The GIL is let go while the engine waits for the weights and taken
      // again for fn.
      .def("lease",
           [](sluice::OffloadedModel& m, int64_t i, const py::function& fn) {
             py::object out;
             {
               py::gil_scoped_release nogil;
               m.call(i, [&](const at::Tensor& w, const at::Tensor& b) {
                 py::gil_scoped_acquire gil;
                 out = fn(w, b.defined() ? py::cast(b) : py::none());
                 return at::Tensor();
               });
             }
             return out;
           },
           py::arg("index"), py::arg("fn"))
      .def("layers", &sluice::OffloadedModel::layers)
      .def("stored_dtype", &sluice::OffloadedModel::stored_dtype, py::arg("index"))
      .def("stored_layer", &sluice::OffloadedModel::stored_layer, py::arg("index"), release_gil())
      .def("linear", &sluice::OffloadedModel::linear, py::arg("index"), py::arg("x"), release_gil())
      .def("embedding", &sluice::OffloadedModel::embedding, py::arg("index"), py::arg("ids"), release_gil())
      // fn(weight, bias or None) runs with the GIL taken again (pybind's std::function wrapper).
      .def("call",
           [](sluice::OffloadedModel& m, int64_t i, const std::function<at::Tensor(at::Tensor, std::optional<at::Tensor>)>& fn) {
             return m.call(i, [&](const at::Tensor& w, const at::Tensor& b) {
               return fn(w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
             });
           },
           py::arg("index"), py::arg("fn"), release_gil())
      .def("begin_forward", &sluice::OffloadedModel::begin_forward, py::arg("kind") = "", release_gil())
      .def("end_forward", &sluice::OffloadedModel::end_forward, py::arg("aborted") = false, release_gil())
      .def("stats_json", &sluice::OffloadedModel::stats_json, py::arg("indent") = -1, release_gil())
      .def("set_vram_budget", &sluice::OffloadedModel::set_vram_budget, py::arg("budget"), release_gil())
      .def("write_trace", &sluice::OffloadedModel::write_trace, py::arg("path"), release_gil())
      .def("write_timeline_svg", &sluice::OffloadedModel::write_timeline_svg, py::arg("path"), release_gil())
      .def("remove", &sluice::OffloadedModel::remove, release_gil())
      .def("removed", &sluice::OffloadedModel::removed);
}
