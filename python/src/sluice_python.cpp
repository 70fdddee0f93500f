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

// LockedModel::locate_nonfinite's finding as a dict, or None (GIL held): one key per field
// of the record (Note [field lists] in sluice/stats.hpp).
py::object nonfinite_dict(const std::optional<sluice::NonFiniteReport>& r) {
  if (!r) return py::none();
  py::dict d;
#define SLUICE_DICT_FIELD(type, name) d[#name] = r->name;
  SLUICE_NONFINITE_REPORT_FIELDS(SLUICE_DICT_FIELD)
#undef SLUICE_DICT_FIELD
  return d;
}

// A prefetch option as Python gives it: "auto" or a number of layers (an int or its string).
std::string prefetch_option(const py::handle& prefetch) {
  return py::isinstance<py::int_>(prefetch) ? std::to_string(prefetch.cast<int64_t>()) : prefetch.cast<std::string>();
}

// An option struct from Python's keyword arguments, by its one field list (Note [field
// lists] in sluice/stats.hpp): each keyword sets the field of its name, cast to the field's
// type (a TypeError names a keyword of the wrong type); the others, and those given as None,
// keep the struct's defaults; an unknown keyword is a TypeError naming it, as for a Python function. The
// prefetch option also takes a number of layers as an int.
template <typename T>
void set_option(T& field, const char*, const py::handle& value) {
  field = value.cast<T>();
}

void set_option(std::string& field, const char* name, const py::handle& value) {
  field = std::string(name) == "prefetch" ? prefetch_option(value) : value.cast<std::string>();
}

template <typename Options, typename Fields>
Options options_from_kwargs(const char* what, const py::kwargs& kwargs, Fields fields) {
  Options o;
  for (const auto& item : kwargs) {
    const std::string key = py::str(item.first);
    bool known = false;
    fields(o, [&](const char* name, auto& field) {
      if (key != name) return;
      known = true;
      if (item.second.is_none()) return;  // None: the field's default
      try {
        set_option(field, name, item.second);
      } catch (const py::cast_error&) {
        throw py::type_error(std::string(what) + "(): keyword argument '" + key + "' has the wrong type (" +
                             std::string(py::str(py::type::handle_of(item.second).attr("__name__"))) + ")");
      }
    });
    if (!known) throw py::type_error(std::string(what) + "() got an unexpected keyword argument '" + key + "'");
  }
  return o;
}

#define SLUICE_VISIT_OPTION(type, name, default_value) visit(#name, o.name);

sluice::RuntimeOptions runtime_options(const py::kwargs& kwargs) {
  return options_from_kwargs<sluice::RuntimeOptions>("RuntimeOptions", kwargs, [](sluice::RuntimeOptions& o, auto&& visit) {
    SLUICE_RUNTIME_OPTIONS_FIELDS(SLUICE_VISIT_OPTION)
  });
}

sluice::LoadOptions load_options(const py::kwargs& kwargs) {
  return options_from_kwargs<sluice::LoadOptions>("LoadOptions", kwargs, [](sluice::LoadOptions& o, auto&& visit) {
    SLUICE_LOAD_OPTIONS_FIELDS(SLUICE_VISIT_OPTION)
  });
}

sluice::OffloadOptions offload_options(const py::kwargs& kwargs) {
  return options_from_kwargs<sluice::OffloadOptions>("OffloadedModel", kwargs, [](sluice::OffloadOptions& o, auto&& visit) {
    SLUICE_OFFLOAD_MODEL_FIELDS(SLUICE_VISIT_OPTION)
    SLUICE_OFFLOAD_CACHE_FIELDS(SLUICE_VISIT_OPTION)
  });
}

#undef SLUICE_VISIT_OPTION

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

  // Keyword arguments only, named as the C++ fields; each field readable (Note [field lists]).
#define SLUICE_READ_OPTION(type, name, default_value) options.def_readonly(#name, &Options::name);
  {
    using Options = sluice::RuntimeOptions;
    py::class_<Options> options(m, "RuntimeOptions");
    options.def(py::init([](const py::kwargs& kwargs) { return runtime_options(kwargs); }));
    SLUICE_RUNTIME_OPTIONS_FIELDS(SLUICE_READ_OPTION)
  }
  {
    using Options = sluice::LoadOptions;
    py::class_<Options> options(m, "LoadOptions");
    options.def(py::init([](const py::kwargs& kwargs) { return load_options(kwargs); }));
    SLUICE_LOAD_OPTIONS_FIELDS(SLUICE_READ_OPTION)
  }
#undef SLUICE_READ_OPTION

  py::class_<sluice::LoraHandle>(m, "LoraHandle")
      .def_property_readonly("patched_layers", &sluice::LoraHandle::patched_layers)
      .def_property_readonly("active", &sluice::LoraHandle::active)
      .def("remove", &sluice::LoraHandle::remove, release_gil());

  py::class_<sluice::LLLiteHandle>(m, "LLLiteHandle")
      .def_property_readonly("modules", &sluice::LLLiteHandle::modules)
      .def_property_readonly("bound_layers", &sluice::LLLiteHandle::bound_layers)
      .def_property_readonly("device_bytes", &sluice::LLLiteHandle::device_bytes)
      .def_property_readonly("active", &sluice::LLLiteHandle::active)
      .def_property_readonly("weight", &sluice::LLLiteHandle::weight)
      .def("set_weight", &sluice::LLLiteHandle::set_weight, py::arg("weight"), release_gil())
      .def("remove", &sluice::LLLiteHandle::remove, release_gil());

  py::class_<sluice::LockedModel>(m, "LockedModel")
      .def(
          "forward",
          [](sluice::LockedModel& m, const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context,
             const std::optional<py::function>& progress, const std::optional<at::Tensor>& cross_attn_mask,
             const std::optional<std::vector<int64_t>>& mask_blocks) {
            // Regional prompting (README, "Regional prompting"): the mask and its blocks.
            sluice::ForwardOptions options;
            options.cross_attn_mask = cross_attn_mask;
            if (mask_blocks) options.mask_blocks = *mask_blocks;
            // Note [Ctrl-C in a forward]: signals are checked between layers on the main thread.
            const bool check_signals = PyThread_get_thread_ident() == main_thread_ident;
            if (!progress && !check_signals) {
              py::gil_scoped_release release;
              return m.forward(x, timesteps, context, options);
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
            options.progress = call;
            try {
              py::gil_scoped_release release;
              return m.forward(x, timesteps, context, options);
            } catch (PythonInterrupt& e) {
              throw e.error;  // the GIL is held again: pybind11 raises it (KeyboardInterrupt)
            }
          },
          py::arg("x"), py::arg("timesteps"), py::arg("context"), py::arg("progress") = py::none(),
          py::arg("cross_attn_mask") = std::nullopt, py::arg("mask_blocks") = std::nullopt)
      .def(
          "encode_text",
          [](sluice::LockedModel& m, const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
             const std::optional<at::Tensor>& t5_weights, const std::optional<std::vector<at::Tensor>>& qwen35_hidden,
             const std::optional<at::Tensor>& qwen35_mask, const std::optional<at::Tensor>& timesteps) {
            // The semantic connector's inputs (README "Anima-3.8B v1.1's semantic connector").
            sluice::SemanticInputs semantic;
            if (qwen35_hidden) semantic.qwen35_hidden = *qwen35_hidden;
            if (qwen35_mask) semantic.qwen35_mask = *qwen35_mask;
            if (timesteps) semantic.timesteps = *timesteps;
            return m.encode_text(qwen_hidden, t5_ids, t5_weights, semantic);
          },
          py::arg("qwen_hidden"), py::arg("t5_ids"), py::arg("t5_weights") = std::nullopt,
          py::arg("qwen35_hidden") = std::nullopt, py::arg("qwen35_mask") = std::nullopt,
          py::arg("timesteps") = std::nullopt, release_gil())
      .def(
          "locate_nonfinite",
          [](sluice::LockedModel& m, const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context,
             const std::optional<at::Tensor>& cross_attn_mask, const std::optional<std::vector<int64_t>>& mask_blocks) {
            sluice::ForwardOptions options;
            options.cross_attn_mask = cross_attn_mask;
            if (mask_blocks) options.mask_blocks = *mask_blocks;
            std::optional<sluice::NonFiniteReport> r;
            {
              py::gil_scoped_release release;
              r = m.locate_nonfinite(x, timesteps, context, options);
            }
            return nonfinite_dict(r);
          },
          py::arg("x"), py::arg("timesteps"), py::arg("context"), py::arg("cross_attn_mask") = std::nullopt,
          py::arg("mask_blocks") = std::nullopt)
      .def(
          "locate_nonfinite_text",
          [](sluice::LockedModel& m, const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
             const std::optional<at::Tensor>& t5_weights, const std::optional<std::vector<at::Tensor>>& qwen35_hidden,
             const std::optional<at::Tensor>& qwen35_mask, const std::optional<at::Tensor>& timesteps) {
            sluice::SemanticInputs semantic;  // as encode_text
            if (qwen35_hidden) semantic.qwen35_hidden = *qwen35_hidden;
            if (qwen35_mask) semantic.qwen35_mask = *qwen35_mask;
            if (timesteps) semantic.timesteps = *timesteps;
            std::optional<sluice::NonFiniteReport> r;
            {
              py::gil_scoped_release release;
              r = m.locate_nonfinite_text(qwen_hidden, t5_ids, t5_weights, semantic);
            }
            return nonfinite_dict(r);
          },
          py::arg("qwen_hidden"), py::arg("t5_ids"), py::arg("t5_weights") = std::nullopt,
          py::arg("qwen35_hidden") = std::nullopt, py::arg("qwen35_mask") = std::nullopt,
          py::arg("timesteps") = std::nullopt)
      .def(
          "apply_lora",
          [](sluice::LockedModel& l, const std::string& path, double scale, const std::string& block_layout) {
            const sluice::BlockLayout layout = sluice::parse_block_layout(block_layout);
            py::gil_scoped_release release;
            return l.apply_lora(path, scale, layout);
          },
          py::arg("path"), py::arg("scale") = 1.0, py::arg("block_layout") = "measured")
      .def(
          "apply_lllite",
          [](sluice::LockedModel& l, const std::string& path, const std::optional<at::Tensor>& cond_image, double weight,
             const std::optional<at::Tensor>& mask, const std::string& block_layout) {
            const sluice::BlockLayout layout = sluice::parse_block_layout(block_layout);
            py::gil_scoped_release release;
            return l.apply_lllite(path, cond_image ? *cond_image : at::Tensor(), weight, mask, layout);
          },
          py::arg("path"), py::arg("cond_image"), py::arg("weight") = 1.0, py::arg("mask") = std::nullopt,
          py::arg("block_layout") = "measured")
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
      // The other keywords are OffloadOptions's fields (its two field lists); None keeps a
      // field's default.
      .def(py::init([](sluice::ModelCache* cache, const py::kwargs& kwargs) {
             const sluice::OffloadOptions o = offload_options(kwargs);
             py::gil_scoped_release nogil;
             return cache ? std::make_unique<sluice::OffloadedModel>(*cache, o)
                          : std::make_unique<sluice::OffloadedModel>(o);
           }),
           py::arg("cache") = nullptr,
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
