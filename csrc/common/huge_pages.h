// Large CPU outputs on transparent huge pages. glibc's malloc serves every block of 32 MiB and more with a fresh
// mmap, so such an output is new memory whose first write faults in 4 KB pages: 8192 faults for a 32 MiB tensor,
// each zeroing a page in the kernel, which costs more than the memory-bound kernel that writes it (3x the time of
// an RMSNorm forward on 8192 x 1024 floats). Advising MADV_HUGEPAGE on the whole 2 MB pages inside the output
// before anything writes it (what torch's allocator does for every block of 2 MB and more under
// THP_MEM_ALLOC_ENABLE=1) makes those 16 faults. Smaller blocks, which glibc reuses from its heap once its dynamic
// threshold has risen, are left alone: advice there would stay on memory that other allocations share. Only
// advice: pages already present are unchanged, a kernel with THP "never" ignores it, and FUSED_HUGE_PAGES=0 turns
// it off.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace fused {

constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
constexpr uintptr_t kHugePageMinBytes = uintptr_t(32) << 20;  // glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit

inline bool huge_pages_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("FUSED_HUGE_PAGES");
    return !(env && std::strcmp(env, "0") == 0);
  }();
  return enabled;
}

// [p, p + bytes) of CPU memory advised MADV_HUGEPAGE (its whole 2 MB pages) where bytes >= kHugePageMinBytes.
inline void advise_huge_pages(uintptr_t p, uintptr_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kHugePageMinBytes || !huge_pages_enabled()) return;
  const uintptr_t first = (p + kHugePage - 1) & ~(kHugePage - 1), last = (p + bytes) & ~(kHugePage - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice: errors ignored
#else
  (void)p, (void)bytes;
#endif
}

// t's storage advised (CPU tensors; others unchanged).
inline void advise_huge_pages(const at::Tensor& t) {
  if (t.defined() && t.is_cpu() && t.has_storage())
    advise_huge_pages(reinterpret_cast<uintptr_t>(t.storage().data()), t.storage().nbytes());
}

// at::empty / at::empty_like for an output the kernel is about to write whole.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  advise_huge_pages(t);
  return t;
}
inline at::Tensor empty_output_like(const at::Tensor& like) {
  at::Tensor t = at::empty_like(like);
  advise_huge_pages(t);
  return t;
}

}  // namespace fused
