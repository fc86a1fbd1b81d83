// The scheduler behind csrc/common/cuda_host.h: CUDA threads as fibers, blocks one at a time, and the few CUDA
// runtime calls the launchers make (cudaGetLastError, cudaGetDevice, cudaDeviceGetAttribute,
// cudaGetErrorString), defined here in place of libcudart's.
#include "common/cuda_host.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

// Switches stacks: saves the callee-saved registers, the SSE and x87 control words and the stack pointer into
// *save, and resumes the context whose stack pointer is `load`. A new fiber's stack starts as if it had been
// switched away from just before fused_emu_start, which calls r13(r12).
extern "C" void fused_emu_switch(void** save, void* load);
extern "C" void fused_emu_start();
__asm__(R"(
  .text
  .p2align 4
  .globl fused_emu_switch
  .hidden fused_emu_switch
  .type fused_emu_switch, @function
fused_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fused_emu_switch, .-fused_emu_switch

  .p2align 4
  .globl fused_emu_start
  .hidden fused_emu_start
  .type fused_emu_start, @function
fused_emu_start:
  andq $-16, %rsp
  movq %r12, %rdi
  callq *%r13
  ud2
  .size fused_emu_start, .-fused_emu_start
)");

extern "C" char __start_fused_emu_shared[], __stop_fused_emu_shared[];

namespace fused {
namespace emu {

uint3 thread_idx, block_idx;
dim3 block_dim, grid_dim;

namespace {

constexpr size_t kStackBytes = 256 << 10;
constexpr size_t kGuardBytes = 4096;  // below each stack, unmapped: an overflow faults instead of corrupting
constexpr int kWarp = 32;

enum class State { ready, at_barrier, at_warp, done };

struct Thread {
  void* sp = nullptr;
  char* stack = nullptr;  // the top of this thread's stack
  State state = State::done;
  uint3 idx{};
  // at_barrier: where
  const char* file = nullptr;
  int line = 0;
  // at_warp: the collective, and its result once every lane of the mask is there
  Collective kind{};
  unsigned mask = 0;
  uint64_t bits = 0, result = 0;
  int arg = 0, width = 0;
};

struct Scheduler {
  std::vector<Thread> threads;
  void* home = nullptr;  // the scheduler's own stack pointer while a fiber runs
  Thread* running = nullptr;
  void (*kernel)(void*) = nullptr;
  void* ctx = nullptr;
  std::string fault;  // set by a thread that found an error; the block is abandoned
};

Scheduler sched;
std::mutex launch_mutex;  // one emulated launch at a time in the process
int sm_count = 2;
uint64_t schedule_seed = 1;
thread_local cudaError_t last_error = cudaSuccess;
thread_local std::string last_message;

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

const char* collective_name(Collective k) {
  switch (k) {
    case Collective::shfl_idx: return "__shfl_sync";
    case Collective::shfl_up: return "__shfl_up_sync";
    case Collective::shfl_down: return "__shfl_down_sync";
    case Collective::shfl_xor: return "__shfl_xor_sync";
    case Collective::syncwarp: return "__syncwarp";
    case Collective::ballot: return "__ballot_sync";
    default: return "__all_sync";
  }
}

std::string where(const Thread& t) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "thread (%u,%u,%u) of block (%u,%u,%u)", t.idx.x, t.idx.y, t.idx.z, block_idx.x,
                block_idx.y, block_idx.z);
  return buf;
}

[[noreturn]] void fiber_main(Thread* t) {
  sched.kernel(sched.ctx);
  t->state = State::done;
  fused_emu_switch(&t->sp, sched.home);
  __builtin_unreachable();
}

// The calling fiber waits (its state already set) until the scheduler resumes it.
void yield() {
  Thread* t = sched.running;
  fused_emu_switch(&t->sp, sched.home);
}

void resume(Thread& t) {
  sched.running = &t;
  thread_idx = t.idx;
  t.state = State::ready;
  fused_emu_switch(&sched.home, t.sp);
}

// A fresh fiber for thread t: the frame fused_emu_switch pops, returning into fused_emu_start.
void start_fiber(Thread& t) {
  auto* sp = reinterpret_cast<uint64_t*>(t.stack);
  *--sp = 0;                                          // alignment
  *--sp = reinterpret_cast<uint64_t>(&fused_emu_start);  // return address
  *--sp = 0;                                          // rbp
  *--sp = 0;                                          // rbx
  *--sp = reinterpret_cast<uint64_t>(&t);             // r12: the argument
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);    // r13: the function
  *--sp = 0;                                          // r14
  *--sp = 0;                                          // r15
  *--sp = 0x037Full << 32 | 0x1F80;                   // x87 control word, MXCSR: round to nearest, no flush to zero
  t.sp = sp;
  t.state = State::ready;
}

void ensure_threads(size_t n) {
  while (sched.threads.size() < n) {
    void* mem = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) throw std::runtime_error("CUDA emulation: cannot map a thread stack");
    mprotect(mem, kGuardBytes, PROT_NONE);
    Thread t;
    t.stack = static_cast<char*>(mem) + kGuardBytes + kStackBytes;
    sched.threads.push_back(t);
  }
}

// Releases the lanes of every warp collective that all the non-exited lanes of its mask have reached (lanes that
// exited, or that the block does not have, take no part: a shuffle reading from one gets 0xff bytes, as CUDA leaves
// it undefined); records a fault where lanes of one mask wait at different collectives. Returns whether any lane
// was released.
bool release_warps(int n) {
  bool released = false;
  for (int w0 = 0; w0 < n; w0 += kWarp) {
    const int lanes = std::min(kWarp, n - w0);
    for (int l = 0; l < lanes; ++l) {
      Thread& t = sched.threads[w0 + l];
      if (t.state != State::at_warp) continue;
      unsigned taking_part = 0;
      bool complete = true;
      for (int m = 0; m < lanes; ++m) {
        const Thread& o = sched.threads[w0 + m];
        if (!(t.mask >> m & 1) || o.state == State::done) continue;
        if (o.state != State::at_warp) {
          complete = false;
        } else if (o.kind != t.kind || o.mask != t.mask || o.width != t.width) {
          sched.fault = where(t) + ": " + collective_name(t.kind) + " and lane " + std::to_string(m) + "'s " +
                        collective_name(o.kind) + " of one mask differ in collective, mask or width";
          return false;
        }
        taking_part |= 1u << m;
      }
      if (!complete) continue;
      uint64_t votes = 0;
      for (int m = 0; m < kWarp; ++m)
        if (taking_part >> m & 1) votes |= uint64_t(sched.threads[w0 + m].bits != 0) << m;
      for (int m = 0; m < kWarp; ++m) {
        if (!(taking_part >> m & 1)) continue;
        Thread& o = sched.threads[w0 + m];
        const int w = o.width, seg = m / w * w, pos = m % w;
        int src = m;
        switch (o.kind) {
          case Collective::shfl_idx: src = seg + ((o.arg % w) + w) % w; break;
          case Collective::shfl_up: src = pos >= o.arg ? m - o.arg : m; break;
          case Collective::shfl_down: src = pos + o.arg < w ? m + o.arg : m; break;
          case Collective::shfl_xor: src = (m ^ o.arg) >= seg + w ? m : m ^ o.arg; break;
          default: break;
        }
        switch (o.kind) {
          case Collective::ballot: o.result = votes; break;
          case Collective::all: o.result = votes == taking_part; break;
          case Collective::syncwarp: o.result = 0; break;
          default: o.result = (taking_part >> src & 1) ? sched.threads[w0 + src].bits : ~uint64_t(0);
        }
        o.state = State::ready;
      }
      released = true;
    }
  }
  return released;
}

// Every thread of the block at a __syncthreads (exited ones aside): one and the same, or a fault.
bool release_barrier(int n) {
  const Thread* first = nullptr;
  for (int i = 0; i < n; ++i) {
    const Thread& t = sched.threads[i];
    if (t.state == State::done) continue;
    if (t.state != State::at_barrier) return false;
    if (!first) first = &t;
    else if (t.line != first->line || std::strcmp(t.file, first->file) != 0) {
      sched.fault = where(t) + " waits at __syncthreads (" + t.file + ":" + std::to_string(t.line) + ") while " +
                    where(*first) + " waits at another (" + first->file + ":" + std::to_string(first->line) + ")";
      return false;
    }
  }
  if (!first) return false;
  for (int i = 0; i < n; ++i)
    if (sched.threads[i].state == State::at_barrier) sched.threads[i].state = State::ready;
  return true;
}

std::string waiting_at(const Thread& t) {
  if (t.state == State::at_barrier) return std::string("__syncthreads (") + t.file + ":" + std::to_string(t.line) + ")";
  if (t.state == State::at_warp) return collective_name(t.kind);
  return "exited";
}

// "deadlock in block (x,y,z): threads 0-15 wait at ..., threads 16-63 at ...", threads by linear index.
std::string deadlock(int n) {
  std::string s = "deadlock in block (" + std::to_string(block_idx.x) + "," + std::to_string(block_idx.y) + "," +
                  std::to_string(block_idx.z) + "): no thread can run;";
  for (int i = 0; i < n;) {
    const std::string at = waiting_at(sched.threads[i]);
    int j = i + 1;
    while (j < n && waiting_at(sched.threads[j]) == at) ++j;
    s += " threads " + std::to_string(i) + "-" + std::to_string(j - 1) + ": " + at + ";";
    i = j;
  }
  return s;
}

// Shared memory: all of it is filled with 0xff before a launch's first block; the 64-byte lines that block leaves
// changed are the launch's, refilled before each later block.
struct SharedLines {
  std::vector<std::pair<size_t, size_t>> ranges;  // [begin, end) byte offsets
  void fill_all() { std::memset(__start_fused_emu_shared, 0xff, size()); }
  void learn() {
    ranges.clear();
    constexpr size_t kLine = 64;
    for (size_t i = 0; i < size(); i += kLine) {
      const size_t end = std::min(size(), i + kLine);
      bool dirty = false;
      for (size_t j = i; j < end && !dirty; ++j)
        dirty = static_cast<unsigned char>(__start_fused_emu_shared[j]) != 0xff;
      if (!dirty) continue;
      if (!ranges.empty() && ranges.back().second == i) ranges.back().second = end;
      else ranges.emplace_back(i, end);
    }
  }
  void refill() {
    for (const auto& r : ranges) std::memset(__start_fused_emu_shared + r.first, 0xff, r.second - r.first);
  }
  static size_t size() { return size_t(__stop_fused_emu_shared - __start_fused_emu_shared); }
};

// Runs one block to the end; false with sched.fault set on an error.
bool run_block(uint64_t linear, int n, uint64_t& rng) {
  block_idx = {unsigned(linear % grid_dim.x), unsigned(linear / grid_dim.x % grid_dim.y),
               unsigned(linear / grid_dim.x / grid_dim.y)};
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  for (int i = 0; i < n; ++i) {
    Thread& t = sched.threads[i];
    t.idx = {unsigned(i % block_dim.x), unsigned(i / block_dim.x % block_dim.y),
             unsigned(i / block_dim.x / block_dim.y)};
    start_fiber(t);
  }
  for (;;) {
    if (schedule_seed)
      for (int i = n - 1; i > 0; --i) std::swap(order[i], order[splitmix(rng) % (i + 1)]);
    for (int i : order) {
      if (sched.threads[i].state == State::ready) resume(sched.threads[i]);
      if (!sched.fault.empty()) return false;
    }
    if (release_warps(n)) continue;
    if (!sched.fault.empty()) return false;
    if (release_barrier(n)) continue;
    if (!sched.fault.empty()) return false;
    bool all_done = true;
    for (int i = 0; i < n; ++i) all_done &= sched.threads[i].state == State::done;
    if (all_done) return true;
    sched.fault = deadlock(n);
    return false;
  }
}

void fail(cudaError_t err, std::string message) {
  last_error = err;
  last_message = std::move(message);
}

}  // namespace

void run_grid(dim3 grid, dim3 block, size_t smem, void (*kernel)(void*), void* ctx) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
  char config[160];
  std::snprintf(config, sizeof config, "launch of grid (%u,%u,%u), block (%u,%u,%u)", grid.x, grid.y, grid.z,
                block.x, block.y, block.z);
  if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 || blocks == 0 ||
      grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
    return fail(cudaErrorInvalidConfiguration, std::string(config) + ": beyond the limits of a CUDA device");
  if (smem != 0) return fail(cudaErrorInvalidValue, std::string(config) + ": dynamic shared memory is not emulated");
  std::lock_guard<std::mutex> lock(launch_mutex);
  ensure_threads(threads);
  sched.kernel = kernel;
  sched.ctx = ctx;
  sched.fault.clear();
  grid_dim = grid;
  block_dim = block;
  // Blocks in the order i -> (i * step + offset) mod blocks, step coprime with blocks.
  uint64_t rng = schedule_seed, step = 1, offset = 0;
  if (schedule_seed) {
    offset = splitmix(rng) % blocks;
    step = splitmix(rng) % blocks | 1;
    while (std::gcd(step, blocks) != 1) step += 2;
  }
  SharedLines shared;
  shared.fill_all();
  for (uint64_t i = 0; i < blocks; ++i) {
    if (i > 0) shared.refill();
    uint64_t block_rng = schedule_seed ^ (i * 0xD1B54A32D192ED03ull);
    if (!run_block((i * step + offset) % blocks, int(threads), block_rng))
      return fail(cudaErrorLaunchFailure, std::string(config) + ": " + sched.fault);
    if (i == 0) shared.learn();
  }
}

void syncthreads(const char* file, int line) {
  Thread* t = sched.running;
  t->state = State::at_barrier;
  t->file = file;
  t->line = line;
  yield();
}

uint64_t warp_collective(Collective kind, unsigned mask, uint64_t bits, int arg, int width) {
  Thread* t = sched.running;
  const int lane = int(t - sched.threads.data()) % kWarp;
  if (!(mask >> lane & 1) || width < 1 || width > kWarp || (width & (width - 1))) {
    sched.fault = where(*t) + ": " + collective_name(kind) + " with mask " + std::to_string(mask) + " and width " +
                  std::to_string(width) + " (the calling lane must be in the mask; width a power of 2 up to 32)";
    yield();  // never resumed: the block is abandoned
  }
  t->state = State::at_warp;
  t->kind = kind;
  t->mask = mask;
  t->bits = bits;
  t->arg = arg;
  t->width = width;
  yield();
  return t->result;
}

const char* last_fault() { return last_message.c_str(); }
void set_sm_count(int sms) { sm_count = sms; }
void set_schedule_seed(uint64_t seed) { schedule_seed = seed; }

}  // namespace emu
}  // namespace fused

// ---- the CUDA runtime calls of the launchers ----
cudaError_t cudaGetLastError() {
  const cudaError_t err = fused::emu::last_error;
  fused::emu::last_error = cudaSuccess;
  return err;
}

cudaError_t cudaPeekAtLastError() { return fused::emu::last_error; }

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0 || attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = fused::emu::sm_count;
  return cudaSuccess;
}

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    default: return "unknown error";
  }
}
