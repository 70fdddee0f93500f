#include "offload/device/cpu_pool.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace sluice::offload {

CpuPool::~CpuPool() {
  for (auto& [n, block] : free_) std::free(block.first);
}

void* CpuPool::take(size_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  current_ += static_cast<int64_t>(n);
  peak_ = std::max(peak_, current_);
  const auto [lo, hi] = free_.equal_range(n);
  for (auto it = lo; it != hi; ++it) {
    if (it->second.second > progress_->done.load()) continue;
    void* p = it->second.first;
    if (it->second.second) std::memset(p, 0xFF, n);  // deferred: poisoned only now
    free_.erase(it);
    cached_ -= n;
    return p;
  }
  void* p = std::aligned_alloc(64, (std::max<size_t>(n, 1) + 63) / 64 * 64);
  if (!p) {
    current_ -= static_cast<int64_t>(n);
    TORCH_CHECK(false, "strict cpu device: out of memory allocating ", n, " bytes");
  }
  reserved_ += static_cast<int64_t>(n);
  return p;
}

void CpuPool::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = free_.begin(); it != free_.end();) {
    if (it->second.second > progress_->done.load()) {
      ++it;
      continue;
    }
    std::free(it->second.first);
    reserved_ -= static_cast<int64_t>(it->first);
    cached_ -= it->first;
    it = free_.erase(it);
  }
}

void CpuPool::give(void* p, size_t n, uint64_t fence) {
  if (!fence) std::memset(p, 0xFF, n);
  std::lock_guard<std::mutex> lock(mutex_);
  current_ -= static_cast<int64_t>(n);
  if (cached_ + n > kMaxCached) {
    std::free(p);
    reserved_ -= static_cast<int64_t>(n);
    return;
  }
  free_.emplace(n, std::make_pair(p, fence));
  cached_ += n;
}

DeviceAllocator::AllocatorStats CpuPool::stats() const {
  DeviceAllocator::AllocatorStats a;
  std::lock_guard<std::mutex> lock(mutex_);
  a.available = true;
  a.current_bytes = current_;
  a.peak_bytes = peak_;
  a.reserved_bytes = reserved_;
  return a;
}

void CpuPool::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_ = current_;
}

}  // namespace sluice::offload
