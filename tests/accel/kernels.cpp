// The test accelerator's operators. Memory management and copies have kernels of their
// own (they decide what is asynchronous); every other operator runs through one boxed
// fallback that aliases device memory (host memory underneath) as CPU tensors, runs the
// CPU kernel in stream order, and hands results back as device tensors: views of device
// inputs stay views, anything new is copied into memory from the device allocator.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/accel/runtime.h"

namespace sluice::accel {
namespace {

constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);

bool on_device(const at::Tensor& t) { return t.defined() && t.device().is_privateuseone(); }

// The device tensor's memory as a CPU tensor (same bytes, sizes and strides).
at::Tensor as_cpu(const at::Tensor& t) {
  if (!on_device(t)) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

void check_options(std::optional<c10::Layout> layout, std::optional<bool> pin) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "testaccel: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin), "testaccel: pin_memory is for CPU tensors only");
}

at::Tensor empty_memory_format(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin, std::optional<c10::MemoryFormat> memory_format) {
  check_options(layout, pin);
  // As CUDA's empty: tensor factories initialise the device (contract 1).
  at::globalContext().lazyInitDevice(c10::DeviceType::PrivateUse1);
  return at::detail::empty_generic(size, &device_allocator(), kKeys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin) {
  check_options(layout, pin);
  at::globalContext().lazyInitDevice(c10::DeviceType::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, &device_allocator(), kKeys, c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(storage_offset));
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

const at::Tensor& resize(const at::Tensor& self, c10::SymIntArrayRef size, std::optional<at::MemoryFormat> format) {
  synchronize_stream(current_stream());  // a grown storage copies the old bytes on the host
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), format);
}

// Contract 6: a plain host->device copy from pinned memory is asynchronous on the current
// stream; from pageable memory the host waits for it, as for a pageable cudaMemcpyAsync.
// Everything else (device->host, device->device, casts, strided copies) runs in stream
// order on the host.
at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(src.defined() && dst.defined(), "testaccel: copy of an undefined tensor");
  const StreamId stream = current_stream();
  if (on_device(dst) && !on_device(src) && src.scalar_type() == dst.scalar_type() && src.is_contiguous() &&
      dst.is_contiguous() && src.numel() == dst.numel()) {
    if (src.numel() == 0) return dst;
    const void* from = src.data_ptr();
    void* to = dst.data_ptr();
    const size_t bytes = src.nbytes();
    const bool pinned = is_pinned(from);
    if (pinned) pinned_read_begin(from);
    const auto latency = copy_latency();
    const uint64_t at = enqueue(stream, [=] {
      std::this_thread::sleep_for(latency);
      std::memcpy(to, from, bytes);
      if (pinned) pinned_read_end(from);
    });
    if (!(non_blocking && pinned)) wait_for(stream, at);
    return dst;
  }
  synchronize_stream(stream);
  at::Tensor out = as_cpu(dst);
  out.copy_(as_cpu(src));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& src, const at::Tensor& dst) {
  synchronize_stream(current_stream());
  at::native::resize_(dst, src.sizes(), std::nullopt);
  return copy_from(src, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  synchronize_stream(current_stream());
  return at::native::_local_scalar_dense_cpu(as_cpu(self));
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}
at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) { return at::native::set_(self, source); }
at::Tensor& set_source_storage_offset(at::Tensor& self, at::Storage source, int64_t offset, at::IntArrayRef size,
                                      at::IntArrayRef stride) {
  return at::cpu::set_(self, source, offset, size, stride);
}

void record_stream(at::Tensor& self, c10::Stream stream) {
  device_allocator().recordStream(self.storage().data_ptr(), stream);
}

// Operators that CUDA accepts with CPU index tensors beside device tensors.
bool takes_cpu_indices(const c10::OperatorName& name) {
  return name.name == "aten::index" || name.name == "aten::index_put_" || name.name == "aten::_index_put_impl_";
}

struct Aliased {
  at::Tensor device, cpu;
};

// `v` with `f` applied to it when it is a tensor, or to each tensor of it when it is a list.
template <typename F>
void map_tensors(c10::IValue& v, F f) {
  if (v.isTensor()) {
    v = f(v.toTensor());
  } else if (v.isList()) {
    auto list = v.toList().copy();
    for (size_t j = 0; j < list.size(); ++j) {
      const c10::IValue e = list.get(j);
      if (e.isTensor()) list.set(j, f(e.toTensor()));
    }
    v = std::move(list);
  }
}

// A CPU result back on the device: the input itself for an in-place or out= operator, a
// view of the input's storage for a view, else a copy into new device memory.
at::Tensor to_device(const at::Tensor& t, const std::vector<Aliased>& aliased) {
  if (!t.defined() || !t.device().is_cpu()) return t;
  for (const Aliased& a : aliased) {
    if (t.unsafeGetTensorImpl() == a.cpu.unsafeGetTensorImpl()) return a.device;
  }
  if (t.numel() > 0) {
    for (const Aliased& a : aliased) {
      if (!t.storage().is_alias_of(a.cpu.storage())) continue;
      const auto offset = static_cast<const char*>(t.data_ptr()) - static_cast<const char*>(a.device.storage().data());
      TORCH_INTERNAL_ASSERT(offset >= 0 && offset % static_cast<ptrdiff_t>(t.itemsize()) == 0,
                            "testaccel: a view at a byte offset its dtype cannot express");
      at::Tensor v = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(a.device.storage()),
                                                              a.device.key_set(), t.dtype());
      v.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(),
                                                     offset / static_cast<ptrdiff_t>(t.itemsize()));
      return v;
    }
  }
  const auto options = t.options().device(c10::Device(c10::DeviceType::PrivateUse1, 0));
  at::Tensor out = t.is_non_overlapping_and_dense() ? at::empty_strided(t.sizes(), t.strides(), options)
                                                    : at::empty(t.sizes(), options);
  if (t.numel() > 0) as_cpu(out).copy_(t);
  return out;
}

// Runs `host` (a CPU kernel) on the stack of `op` with device tensors aliased as CPU ones,
// in stream order, and hands the results back as device tensors.
template <class Host>
void on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack, Host&& host) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  std::vector<Aliased> aliased;
  std::vector<Aliased> grown;  // empty out= tensors the CPU kernel may resize
  std::string cpu_argument;
  auto convert = [&](const at::Tensor& t, const std::string& arg, bool written) {
    if (on_device(t) && written && t.numel() == 0) {
      // Composite kernels pass empty outputs for the kernel to size (an alias of device
      // memory cannot grow): a CPU tensor now, the device tensor resized after.
      grown.push_back({t, at::empty({0}, t.options().device(at::kCPU))});
      aliased.push_back(grown.back());
      return grown.back().cpu;
    }
    if (on_device(t)) {
      aliased.push_back({t, as_cpu(t)});
      return aliased.back().cpu;
    }
    if (t.defined() && t.device().is_cpu() && t.dim() > 0 && cpu_argument.empty()) cpu_argument = arg;
    return t;
  };
  for (size_t i = 0; i < nargs; ++i) {
    c10::IValue& v = (*stack)[base + i];
    const c10::Argument& argument = schema.arguments()[i];
    const std::string& arg = argument.name();
    const bool written = argument.alias_info() && argument.alias_info()->isWrite();
    if (v.isTensor() || v.isList()) {
      map_tensors(v, [&](const at::Tensor& t) { return convert(t, arg, written); });
    } else if (v.isDevice() && v.toDevice().is_privateuseone()) {
      v = c10::Device(c10::kCPU);  // a factory: it makes its result on the host, copied below
    }
  }
  // Contract 7.
  TORCH_CHECK(aliased.empty() || cpu_argument.empty() || takes_cpu_indices(schema.operator_name()),
              "Expected all tensors to be on the same device, but found at least two devices, ", kBackendName,
              ":0 and cpu! (", schema.name(), ", argument '", cpu_argument, "' is on the CPU)");
  synchronize_stream(current_stream());  // stream order: what was queued before runs first
  host(stack);
  for (Aliased& g : grown) {
    if (g.cpu.numel() == 0 && g.cpu.sizes() == g.device.sizes()) continue;
    g.device.resize_(g.cpu.sizes());
    as_cpu(g.device).copy_(g.cpu);
  }
  const size_t nret = schema.returns().size();
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
    map_tensors((*stack)[i], [&](const at::Tensor& t) { return to_device(t, aliased); });
  }
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  on_host(op, stack, [&](torch::jit::Stack* s) { op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), s); });
}

// aten::convolution sends a device other than the CPU and CUDA to convolution_overrideable,
// for which the CPU has no kernel: its arguments, aten::convolution's own, run as that on
// the host (the CPU's convolution, so bit-identical to it). The LLLite trunk needs it.
void convolution_overrideable(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const c10::OperatorHandle convolution = c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  on_host(op, stack, [](torch::jit::Stack* s) { convolution.callBoxed(s); });
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("record_stream", record_stream);
  // Operators whose generic (CompositeExplicitAutograd) kernel would otherwise serve this
  // device with other numerics than the CPU's: the fallback runs the CPU kernel, so a
  // forward here is bit-identical to one on the CPU and host references hold.
  for (const char* name : {"native_layer_norm", "native_group_norm", "scaled_dot_product_attention"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  m.impl("convolution_overrideable", torch::CppFunction::makeFromBoxedFunction<&convolution_overrideable>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

}  // namespace
}  // namespace sluice::accel
