// The threads tokenmill's fused kernels run on, and the phased jobs they run.
//
// A job is a list of phases, each a number of chunks; a phase starts once every chunk of the
// one before it is done. The calling thread works through the job itself and workers join
// while it is open, each claiming chunks through atomic counters. Nobody waits for a thread
// that has not started: on a loaded machine, where a worker may be descheduled for a whole
// time slice, the caller just does more of the chunks (a fixed split with a barrier per phase
// waited for it at every phase: ~300 ms instead of ~25 ms for 120 one-row products, load 8
// on 2 cores). The only wait left is for a chunk a descheduled thread has already claimed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpu_common.h"

namespace tokenmill {

// Wall time of each kind of phase, summed over jobs while it is on (`benchmarks.steps
// inside-stack`): the caller stamps each phase boundary it reaches, so a phase's time includes
// the wait for its slowest chunk. Off, it costs one relaxed load per job.
class PhaseProfile {
 public:
  struct Entry {
    int64_t nanoseconds = 0, phases = 0, bytes = 0;
  };
  static void enable(bool on);
  static bool enabled() { return enabled_.load(std::memory_order_relaxed); }
  static void add(const char* label, int64_t nanoseconds, int64_t bytes);
  // label -> totals since the last take; clears them.
  static std::vector<std::pair<std::string, Entry>> take();

 private:
  static std::atomic<bool> enabled_;
};

class PhasedJob {
 public:
  using ChunkFn = std::function<void(int64_t chunk, int participant)>;

  // `label` (a string literal) names the phase's kind for PhaseProfile; `bytes`: the weight
  // bytes it reads, for a rate.
  void add_phase(int64_t chunks, ChunkFn run, const char* label = "other", int64_t bytes = 0);
  size_t size() const { return phases_.size(); }
  // Zeroes the counters; the caller, before the job is published.
  void prepare();
  // Run by each participant (0 = the caller) until every phase is done.
  void participate(int participant);

 private:
  struct alignas(64) Counter {
    std::atomic<int64_t> value{0};
  };
  struct Phase {
    int64_t chunks;
    ChunkFn run;
    const char* label;
    int64_t bytes;
  };
  std::vector<Phase> phases_;
  std::vector<Counter> claimed_, done_;
};

class WorkerPool {
 public:
  // The process's pool: torch's intra-op thread count at first use, caller included.
  static WorkerPool& instance();
  // Runs `job` on the calling thread and on up to `threads - 1` workers; returns when it is
  // done and every worker that joined has left it.
  void run(PhasedJob& job, int threads);
  int max_threads() const { return static_cast<int>(workers_.size()) + 1; }
  ~WorkerPool();

 private:
  explicit WorkerPool(int threads);
  void work(int index);

  static constexpr uint32_t kClosed = 1u << 31;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::mutex submit_mutex_;  // held by the caller whose job the pool runs
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint32_t> state_{kClosed};  // kClosed | number of workers inside the job
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stopping_{false};
  PhasedJob* job_ = nullptr;
  int job_threads_ = 1;
};

// Runs `fn(chunk)` for chunks [0, chunks) on the pool as one single-phase job.
void parallel_chunks(int64_t chunks, const std::function<void(int64_t, int)>& fn,
                     int threads = 0, const char* label = "other", int64_t bytes = 0);

}  // namespace tokenmill
