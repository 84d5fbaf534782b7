"""Tensor memory of this process: live bytes and their peak, on CUDA or on the CPU.

CUDA has `torch.cuda.max_memory_allocated`. The CPU has no such counter, so we wrap the CPU
allocator itself. Every CPU tensor storage (DeepSpeed's flat buffers, partitions and buckets,
FSDP2's gathered parameters, gloo's staging tensors) is allocated through
``c10::GetCPUAllocator()``. A small C++ library puts a counting wrapper in front of it: an atomic
count of live bytes and their peak, in every thread. Like the CUDA counter it counts requested bytes
(no allocator rounding) and sees nothing that is not a tensor.

The library is built once per machine with torch's ``load`` into TORCH_EXTENSIONS_DIR and called
through ctypes. It includes c10's allocator header and nothing else, so the build takes 2 s on a
fresh 2-core machine; a pybind11 module (``load_inline``, which includes all of
``torch/extension.h``) took 41 s, which the first `advisor run` of a machine paid.

Only tensors allocated after `install()` are counted, so install it before the model is built.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from profiler.extension_build import exclusive_build

# Why hand-written: c10 has no thread-agnostic, queryable byte counter for CPU tensors (the
# profiler's memory reporter is thread-local and drifts under gloo's worker threads), so we wrap
# the CPU allocator. Blocks still come from the wrapped default allocator.
_ALLOC_HOOK_SOURCE = r"""
#include <c10/core/CPUAllocator.h>
#include <atomic>
#include <mutex>
#include <pthread.h>
#include <unordered_map>
namespace {
std::atomic<int64_t> g_live{0}, g_peak{0};
std::atomic<bool> g_installed{false};
std::mutex g_mutex;
// The block behind each pointer. The context must stay the data pointer itself: oneDNN's bf16
// kernels assert data == context on CPU storages, as the default allocator's DataPtrs have it.
std::unordered_map<void*, std::pair<c10::DataPtr, int64_t>>* g_blocks =
    new std::unordered_map<void*, std::pair<c10::DataPtr, int64_t>>();
void release(void* data) {
  c10::DataPtr inner;
  int64_t nbytes = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_blocks->find(data);
    if (it == g_blocks->end()) return;
    inner = std::move(it->second.first);
    nbytes = it->second.second;
    g_blocks->erase(it);
  }
  g_live.fetch_sub(nbytes);
}  // `inner` frees through the wrapped allocator here
struct CountingAllocator final : c10::Allocator {
  c10::Allocator* base;
  explicit CountingAllocator(c10::Allocator* b) : base(b) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    if (n == 0) return inner;
    void* data = inner.get();
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_blocks->emplace(data, std::make_pair(std::move(inner), int64_t(n)));
    }
    int64_t live = g_live.fetch_add(int64_t(n)) + int64_t(n);
    int64_t peak = g_peak.load();
    while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {}
    return c10::DataPtr(data, data, &release, c10::Device(c10::DeviceType::CPU));
  }
  // oneDNN allocates through raw_allocate/raw_deallocate, which need a context-free deleter
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
// A fork while another thread holds the lock would leave the child's copy locked forever: take it
// around fork() in the parent (the standard pthread_atfork discipline), so forked ranks start free.
void lock_for_fork() { g_mutex.lock(); }
void unlock_after_fork() { g_mutex.unlock(); }
}
extern "C" {
void install() {
  if (g_installed.exchange(true)) return;
  pthread_atfork(&lock_for_fork, &unlock_after_fork, &unlock_after_fork);
  static CountingAllocator* counting = new CountingAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(counting, /*priority=*/100);
}
int64_t live_bytes() { return g_live.load(); }
int64_t peak_bytes() { return g_peak.load(); }
void reset_peak() { g_peak.store(g_live.load()); }
}
"""

_hook: Any = None

COUNTER_EXTENSION = "advisor_cpu_tensor_bytes"


def load_counter() -> Any:
    """Build (cached in TORCH_EXTENSIONS_DIR) and load the counting allocator library; its four
    functions, `install`, `live_bytes`, `peak_bytes` and `reset_peak`, through ctypes. Call it in a
    launcher's parent before forking ranks, so that they inherit it loaded."""
    global _hook
    if _hook is None:
        from torch.utils.cpp_extension import load

        with exclusive_build(COUNTER_EXTENSION) as folder:  # a killed earlier build must not leave us waiting
            source = folder / f"{COUNTER_EXTENSION}.cpp"
            if not source.exists() or source.read_text() != _ALLOC_HOOK_SOURCE:
                source.write_text(_ALLOC_HOOK_SOURCE)  # torch rebuilds when the text (its hash) changes
            path = load(COUNTER_EXTENSION, sources=[str(source)], extra_cflags=["-O2"],
                        is_python_module=False)
        library = ctypes.CDLL(path)
        for name in ("live_bytes", "peak_bytes"):
            getattr(library, name).restype = ctypes.c_int64
        _hook = library
    return _hook


class TensorMemory:
    """Live tensor bytes and their peak on `device`: CUDA's own counters, or the CPU counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        if not self.cuda:
            load_counter().install()
        self.reset_peak()
        self.baseline = self.live()  # what this process already held (a long-lived process's earlier work)

    @property
    def source(self) -> str:
        return "torch.cuda.max_memory_allocated" if self.cuda else "CPU allocator counter (tensor bytes)"

    def live(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.cuda else int(_hook.live_bytes())

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else int(_hook.peak_bytes())

    def peak_since_start(self) -> int:
        """The peak of what was allocated since this counter was made, above what was live then."""
        return max(0, self.peak() - self.baseline)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _hook.reset_peak()
