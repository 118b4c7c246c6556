// Helper threads for the matmuls of small steps, whose work the calling thread can take back.
//
// Why: a step of one or a few tokens runs ~120 small matmuls, each an OpenMP region ending in a
// barrier. On a small machine the server's event loop and its clients share the cores; when one
// preempts a partner thread, every barrier waits for it, and a step on two threads is no faster
// served than on one, though faster alone. Here the items of a matmul (blocks of 8
// output rows) are claimed one at a time from a counter; when none is left to claim, the caller
// computes the items that a helper claimed but did not store (it may be descheduled) and moves on.
// A helper that resumes later finds its item taken and drops its result, so the caller never
// waits for a descheduled helper, and each item is stored exactly once, by the thread that
// computed it, with the same instructions: results do not depend on who computed what.
//
// Memory a late helper may still read stays valid: the job's fields are copied under a sequence
// check; weights live as long as the model; the activations and item states live in buffers that
// only grow, and only while no helper is inside a job. Architecture-neutral.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BATCHGATE_CPU_RELAX() _mm_pause()
#else
#define BATCHGATE_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace batchgate_pool {

// An item's result: up to 4 activation rows by 8 output rows.
constexpr int kItemFloats = 32;

// `Payload`: trivially copyable, everything an item needs; `compute` writes an item's result into
// a local buffer (no shared writes), `store` writes it out.
template <typename Payload>
struct Ops {
  void (*compute)(const Payload&, int64_t item, float* local);
  void (*store)(const Payload&, int64_t item, const float* local);
};

template <typename Payload>
class StealPool {
  static_assert(std::is_trivially_copyable<Payload>::value, "a job's payload is copied by helpers");

 public:
  // How long an idle helper spins before it sleeps: the gaps between a step's matmuls are shorter,
  // the pause between steps (outputs go to the event loop) longer.
  static constexpr int64_t kSpinNs = 60000;

  ~StealPool() { stop_helpers(); }

  // Helpers that take jobs now (0: run() is not to be called).
  int helpers() const { return enabled_ ? static_cast<int>(threads_.size()) : 0; }

  // n helpers from now on, from the calling thread between jobs. 0 leaves the threads asleep, so
  // steps that switch back and forth start no threads.
  void set_helpers(int n) {
    enabled_ = n > 0;
    if (n == 0 || n == static_cast<int>(threads_.size())) return;
    stop_helpers();
    // The jobs so far are over: a helper that starts late still takes the next one.
    const uint64_t seen = seq_.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) threads_.emplace_back([this, seen] { helper(seen); });
  }

  void stop_helpers() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    stop_ = false;
  }

  // Buffers that outlive every job (see the header): at least `bytes`; grown only with no helper
  // inside a job.
  void* scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      invalidate();
      quiesce();
      scratch_.reset(new uint8_t[bytes]);
      scratch_bytes_ = bytes;
    }
    return scratch_.get();
  }

  // Run items 0 .. n - 1 of `payload` on the caller and the helpers; returns once each is stored.
  // Items are claimed in runs (a few per thread and job: fewer shared cache lines move between
  // cores); the caller takes back a helper's run only once it has been out for twice as long as
  // the caller's own runs take (so a helper that is merely working is not duplicated).
  void run(const Payload& payload, Ops<Payload> ops, int64_t n) {
    const int64_t per_run = std::max<int64_t>(1, std::min<int64_t>(kMaxRun, n / kRunsPerJob));
    const int64_t runs = (n + per_run - 1) / per_run;
    // Publish: the fields under an odd sequence, then the claim word and the even sequence.
    invalidate();
    if (static_cast<size_t>(runs) > states_.size()) {
      quiesce();
      states_ = std::vector<State>(runs);  // 0: no job's state
    }
    const uint64_t job = seq_.load(std::memory_order_relaxed) + 1;
    payload_ = payload;
    ops_ = ops;
    size_ = n;
    per_run_ = per_run;
    helpers_done_.store(0, std::memory_order_relaxed);
    claim_.store(job << 32, std::memory_order_relaxed);
    seq_.store(job, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> guard(mutex_);
      wake_.notify_all();
    }
    const uint64_t tag = job << 2;
    // Tests (hold_helpers): let a helper take a run first, so that there is one to take back.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((hold_.load(std::memory_order_acquire) & 1) && threads_.size() > 0 && runs > 1 &&
           (claim_.load(std::memory_order_acquire) & 0xffffffffu) == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
    int64_t own = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t r; (r = claim(job, runs)) >= 0; ++own) {
      // Marked as the caller's, so that it is not taken back below (and counted twice: the caller
      // would end the job while a helper still stores into its output).
      states_[r].v.store(tag | kMine, std::memory_order_relaxed);
      compute_run(payload, ops, r, per_run, n);
    }
    const auto mine = std::chrono::steady_clock::now();
    const auto patience = own > 0 ? 2 * (mine - start) / own : std::chrono::nanoseconds(20000);
    // Every run is claimed; the helpers' are theirs until patience runs out, then taken back (a
    // helper's store after it won its run is waited for: that window is a few instructions).
    for (;;) {
      int64_t done = own + helpers_done_.load(std::memory_order_acquire);
      if (done >= runs) break;
      if (std::chrono::steady_clock::now() - mine < patience) {
        BATCHGATE_CPU_RELAX();
        continue;
      }
      for (int64_t r = 0; r < runs; ++r) {
        uint64_t state = states_[r].v.load(std::memory_order_acquire);
        if (state == (tag | kDone) || state == (tag | kStoring) || state == (tag | kMine)) continue;
        if (states_[r].v.compare_exchange_strong(state, tag | kMine, std::memory_order_acq_rel)) {
          compute_run(payload, ops, r, per_run, n);
          ++own;
          ++taken_back_;
        }
      }
      BATCHGATE_CPU_RELAX();
    }
    std::atomic_thread_fence(std::memory_order_acquire);
  }

  // Items the caller took back from helpers so far (tests).
  int64_t taken_back() const { return taken_back_; }

  // Tests: make helpers hold each run they computed until released, and the caller start only
  // after a helper claimed one (so that it must take that run back). `at_claim`: instead, the
  // helper that claims a job's first run holds right after its claim, before it looks at the run's
  // state. Odd: holding; each hold and release is a new number, so a helper still holding from an
  // earlier hold is released by it.
  void hold_helpers(bool hold, bool at_claim = false) {
    const uint64_t h = hold_.load(std::memory_order_relaxed);
    if (hold) hold_at_claim_.store(at_claim, std::memory_order_relaxed);  // published with hold_
    if (static_cast<bool>(h & 1) != hold) hold_.store(h + 1, std::memory_order_release);
  }

 private:
  enum : uint64_t { kTaken = 1, kStoring = 2, kMine = 3 };
  static constexpr int64_t kRunsPerJob = 16;
  static constexpr int64_t kMaxRun = 64;

  struct alignas(64) State {
    std::atomic<uint64_t> v{0};
  };

  void compute_run(const Payload& payload, Ops<Payload> ops, int64_t r, int64_t per_run, int64_t n) {
    float local[kItemFloats];
    for (int64_t i = r * per_run, end = std::min(n, i + per_run); i < end; ++i) {
      ops.compute(payload, i, local);
      ops.store(payload, i, local);
    }
  }
  static constexpr uint64_t kDone = 0;  // with the job's tag: a fresh job's states never equal it

  // The next unclaimed item of `job`, or -1 (all claimed, or the job is over).
  int64_t claim(uint64_t job, int64_t n) {
    uint64_t word = claim_.load(std::memory_order_relaxed);
    for (;;) {
      if ((word >> 32) != (job & 0xffffffffu) || static_cast<int64_t>(word & 0xffffffffu) >= n) return -1;
      if (claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel)) return word & 0xffffffffu;
    }
  }

  // End the current job for helpers that have not copied it yet (an odd sequence: being written).
  void invalidate() {
    const uint64_t s = seq_.load(std::memory_order_relaxed);
    if (!(s & 1)) seq_.store(s + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }

  // Wait until no helper is inside a job (before a buffer it may read is replaced).
  void quiesce() {
    while (inside_.load(std::memory_order_seq_cst) > 0) std::this_thread::yield();
  }

  void helper(uint64_t seen) {
    std::vector<float> buffer(kMaxRun * kItemFloats);
    float* local = buffer.data();
    for (;;) {
      // Wait for a new job: spin, then sleep.
      uint64_t job = seen;
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kSpinNs);
      for (int k = 0;; ++k) {
        job = seq_.load(std::memory_order_acquire);
        if ((job != seen && !(job & 1)) || stop_) break;
        BATCHGATE_CPU_RELAX();
        if ((k & 63) == 0 && std::chrono::steady_clock::now() > spin_until) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] {
            const uint64_t s = seq_.load(std::memory_order_seq_cst);
            return stop_ || (s != seen && !(s & 1));
          });
          sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      if (stop_) return;
      inside_.fetch_add(1, std::memory_order_seq_cst);
      // Copy the job, then check that it was not replaced meanwhile (nor ended before a buffer grew).
      const Payload payload = payload_;
      const Ops<Payload> ops = ops_;
      const int64_t n = size_;
      const int64_t per_run_copy = per_run_;
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (seq_.load(std::memory_order_seq_cst) == job) {
        const uint64_t tag = job << 2;
        const int64_t per_run = per_run_copy;
        const int64_t runs = (n + per_run - 1) / per_run;
        for (int64_t r; (r = claim(job, runs)) >= 0;) {
          const uint64_t held = hold_.load(std::memory_order_acquire);  // tests: the hold of its claim
          const bool at_claim = (held & 1) && hold_at_claim_.load(std::memory_order_relaxed);
          while (at_claim && r == 0 && hold_.load(std::memory_order_acquire) == held) BATCHGATE_CPU_RELAX();
          // The run is no longer this helper's if its state carries this job's tag (the caller took
          // it back) or a later job's (this job is over: its output may be freed already).
          uint64_t state = states_[r].v.load(std::memory_order_acquire);
          if ((state >> 2) >= job || !states_[r].v.compare_exchange_strong(state, tag | kTaken)) continue;
          // The run into local buffers first: a late helper must not write where the caller went on.
          const int64_t first = r * per_run, count = std::min(n, first + per_run) - first;
          for (int64_t i = 0; i < count; ++i) ops.compute(payload, first + i, local + i * kItemFloats);
          while ((held & 1) && !at_claim && hold_.load(std::memory_order_acquire) == held)
            BATCHGATE_CPU_RELAX();
          uint64_t taken = tag | kTaken;
          if (!states_[r].v.compare_exchange_strong(taken, tag | kStoring, std::memory_order_acq_rel)) continue;
          for (int64_t i = 0; i < count; ++i) ops.store(payload, first + i, local + i * kItemFloats);
          states_[r].v.store(tag | kDone, std::memory_order_release);
          helpers_done_.fetch_add(1, std::memory_order_acq_rel);
        }
      }
      inside_.fetch_sub(1, std::memory_order_acq_rel);
      seen = job;
    }
  }

  std::vector<std::thread> threads_;
  bool enabled_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> hold_{0};
  std::atomic<bool> hold_at_claim_{false};
  std::atomic<int> sleeping_{0};
  std::atomic<int> inside_{0};
  std::atomic<uint64_t> seq_{0};    // the current job's number (even), odd while it is written
  std::atomic<uint64_t> claim_{0};  // job number << 32 | next unclaimed item
  std::atomic<int64_t> helpers_done_{0};  // runs the helpers stored in the current job
  int64_t taken_back_ = 0;
  Payload payload_{};
  Ops<Payload> ops_{};
  int64_t size_ = 0;
  int64_t per_run_ = 1;
  std::vector<State> states_;  // per run of items: job << 2 | state
  std::unique_ptr<uint8_t[]> scratch_;
  size_t scratch_bytes_ = 0;
};

}  // namespace batchgate_pool
