// An emulated accelerator: torch's PrivateUse1 device whose memory lives in host RAM.
//
// Why: NCCL accepts only tensors on the accelerator, and on a CPU-only machine the host and the
// compute device are the same, so a host tensor handed to a GPU collective cannot be caught.
// This device is *not* the CPU: a tensor on it has its own device type, every copy between it
// and the host is explicit, and the collective backend bound to it (`collectives.py`) refuses
// anything else, as NCCL does. Compute runs through torch's CPU kernels (the boxed CPU
// fallback), so results are bit-identical to a CPU run.
//
// Execution is synchronous: there is one stream per device, events complete when recorded,
// and synchronize() returns at once. The allocator counts bytes (allocated and peak, resettable)
// so that memory stats and `empty_cache` paths run as they do on CUDA. Pinned host memory is
// tracked by address range so that `pin_memory()` / `is_pinned()` behave as on a GPU host, and
// memory allocated elsewhere can be registered as pinned, as with cudaHostRegister.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

namespace raytrain_emu {

constexpr c10::DeviceType kEmu = c10::DeviceType::PrivateUse1;
constexpr c10::DeviceIndex kNumDevices = 8;  // like one node's accelerators; all share host RAM

thread_local c10::DeviceIndex current_device = 0;

// ---- device memory --------------------------------------------------------------------------
std::atomic<int64_t> bytes_allocated{0};
std::atomic<int64_t> bytes_peak{0};

struct Allocation {
  void* ptr;
  size_t size;
};

void free_device_memory(void* ctx) {
  auto* allocation = static_cast<Allocation*>(ctx);
  c10::free_cpu(allocation->ptr);
  bytes_allocated -= static_cast<int64_t>(allocation->size);
  delete allocation;
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    int64_t now = bytes_allocated += static_cast<int64_t>(nbytes);
    int64_t peak = bytes_peak.load();
    while (now > peak && !bytes_peak.compare_exchange_weak(peak, now)) {
    }
    return {ptr, new Allocation{ptr, nbytes}, &free_device_memory,
            c10::Device(kEmu, current_device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

DeviceAllocator device_allocator;

// ---- pinned host memory ---------------------------------------------------------------------
std::mutex pinned_mutex;
std::map<uintptr_t, size_t> pinned_ranges;  // start -> size

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned_ranges.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = c10::alloc_cpu(nbytes ? nbytes : 1);
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned_ranges[reinterpret_cast<uintptr_t>(ptr)] = nbytes;
    }
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

PinnedAllocator pinned_allocator;

bool is_pinned_address(const void* data) {
  auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto it = pinned_ranges.upper_bound(address);
  if (it == pinned_ranges.begin()) return false;
  --it;
  return address < it->first + std::max<size_t>(it->second, 1);
}

// Page-locks memory allocated elsewhere (cudaHostRegister's counterpart: a shared staging
// arena the checkpoint writer process maps): it then reads as pinned, as on a GPU host.
void host_register(int64_t address, int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "host_register: nothing to register at ", address);
  // As cudaHostRegister creates CUDA's context: torch reads no pointer as pinned for a device
  // it has not initialised.
  at::globalContext().lazyInitDevice(kEmu);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto inserted = pinned_ranges.emplace(static_cast<uintptr_t>(address), nbytes).second;
  TORCH_CHECK(inserted, "host_register: ", address, " is registered already");
}

void host_unregister(int64_t address) {
  std::lock_guard<std::mutex> lock(pinned_mutex);
  TORCH_CHECK(pinned_ranges.erase(static_cast<uintptr_t>(address)) == 1,
              "host_unregister: ", address, " is not registered");
}

// ---- device guard: one synchronous stream per device ----------------------------------------
struct DeviceGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kEmu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = c10::Device(kEmu, current_device);
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kEmu, current_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kEmu, "expected an emulated device, got ", d);
    TORCH_CHECK(d.index() < kNumDevices, "emulated device index ", int(d.index()),
                " out of range (", int(kNumDevices), " devices)");
    if (d.index() >= 0) current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return kNumDevices; }
  // Work runs when it is issued, so an event is complete as soon as it is recorded.
  void record(void** event, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    if (*event == nullptr) *event = reinterpret_cast<void*>(1);
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, DeviceGuard);

// ---- runtime hooks ----------------------------------------------------------------------------
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  // Kernels run on the host through the CPU fallback, which draws from the CPU generator.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kEmu, current_device); }
  bool isPinnedPtr(const void* data) const override { return is_pinned_address(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kNumDevices; }
  void setCurrentDevice(c10::DeviceIndex device) const override { current_device = device; }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto old = current_device;
    current_device = device;
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  // FSDP2 frees and re-allocates unsharded parameters through `untyped_storage().resize_()`.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};

// ---- kernels that must know the device; everything else runs through the CPU fallback -------
at::Tensor as_cpu(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device, std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "the emulated device holds strided tensors only");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "only host memory can be pinned");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_generic(size, &device_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "the emulated device holds strided tensors only");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "only host memory can be pinned");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_strided_generic(size, stride, &device_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(storage_offset));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}

// Host <-> device and device <-> device copies: both sides are host memory underneath.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  at::Tensor src_host = self.device().type() == kEmu ? as_cpu(self) : self;
  at::Tensor dst_host = dst.device().type() == kEmu ? as_cpu(dst) : dst;
  dst_host.copy_(src_host);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  return at::native::_local_scalar_dense_cpu(as_cpu(self));
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, std::move(source));
}

at::Tensor& set_source_storage_offset(at::Tensor& self, at::Storage storage, int64_t offset,
                                      c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::cpu::set_(self, std::move(storage), offset, size, stride);
}

// Streams are synchronous, so there is nothing to keep alive past a stream's use.
void record_stream(at::Tensor&, c10::Stream) {}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("resize_", resize_);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("view", view);
  m.impl("unfold", unfold);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("record_stream", record_stream);
}

// `param.data = param.to(device)` (FSDP2 moves its states so) asks whether the two tensors
// may share a TensorImpl. torch's answer names the dense backends it knows, which do not
// include PrivateUse1; a dense strided tensor here is the same kind of TensorImpl as the CPU's.
bool compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.is_cpu() || t.device().type() == kEmu);
  };
  if (dense(self) && dense(from)) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", compatible_shallow_copy_type);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

// ---- memory statistics, read by the Python device module -----------------------------------
int64_t memory_allocated() { return bytes_allocated.load(); }
int64_t max_memory_allocated() { return bytes_peak.load(); }
void reset_peak_memory_stats() { bytes_peak.store(bytes_allocated.load()); }

int64_t device_count() { return kNumDevices; }
int64_t get_current_device() { return current_device; }
void set_current_device(int64_t index) {
  TORCH_CHECK(index >= 0 && index < kNumDevices, "emulated device index ", index,
              " out of range (", int(kNumDevices), " devices)");
  current_device = static_cast<c10::DeviceIndex>(index);
}

TORCH_LIBRARY(raytrain_emu, m) {
  m.def("device_count() -> int", &device_count);
  m.def("current_device() -> int", &get_current_device);
  m.def("set_device(int index) -> ()", &set_current_device);
  m.def("memory_allocated() -> int", &memory_allocated);
  m.def("max_memory_allocated() -> int", &max_memory_allocated);
  m.def("reset_peak_memory_stats() -> ()", &reset_peak_memory_stats);
  m.def("host_register(int address, int nbytes) -> ()", &host_register);
  m.def("host_unregister(int address) -> ()", &host_unregister);
}

struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(new Hooks()); }
};
RegisterHooks register_hooks;

}  // namespace raytrain_emu
