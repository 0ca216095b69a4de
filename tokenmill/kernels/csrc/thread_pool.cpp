// WorkerPool and PhasedJob (thread_pool.h).
#include "thread_pool.h"

#include <pthread.h>

#include <chrono>
#include <map>

namespace tokenmill {
namespace {

// Pauses a worker spins for the next job before it sleeps (~50-150 us): back-to-back calls
// (the decoder stack, then the LM head) find it awake, and an idle engine does not burn a core.
constexpr int kIdleSpins = 2000;
// Pauses a thread spins waiting for a chunk another thread holds before it yields its core.
constexpr int kWaitSpins = 4000;

inline void pause() { __builtin_ia32_pause(); }

template <typename Ready>
inline void wait_until(Ready ready) {
  for (int spins = 0; !ready(); ++spins) {
    if (spins < kWaitSpins) {
      pause();
    } else {
      sched_yield();
    }
  }
}

WorkerPool* g_pool = nullptr;

void forget_pool_in_child() {
  g_pool = nullptr;  // its threads do not exist in a forked child; a new pool starts on use
}

}  // namespace

std::atomic<bool> PhaseProfile::enabled_{false};

namespace {
std::mutex g_profile_mutex;
std::map<std::string, PhaseProfile::Entry>& profile_totals() {
  static std::map<std::string, PhaseProfile::Entry> totals;
  return totals;
}
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void PhaseProfile::enable(bool on) { enabled_.store(on, std::memory_order_relaxed); }

void PhaseProfile::add(const char* label, int64_t nanoseconds, int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  Entry& e = profile_totals()[label];
  e.nanoseconds += nanoseconds;
  e.phases += 1;
  e.bytes += bytes;
}

std::vector<std::pair<std::string, PhaseProfile::Entry>> PhaseProfile::take() {
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  std::vector<std::pair<std::string, Entry>> out(profile_totals().begin(), profile_totals().end());
  profile_totals().clear();
  return out;
}

void PhasedJob::add_phase(int64_t chunks, ChunkFn run, const char* label, int64_t bytes) {
  phases_.push_back(Phase{std::max<int64_t>(chunks, 0), std::move(run), label, bytes});
}

void PhasedJob::prepare() {
  claimed_ = std::vector<Counter>(phases_.size());
  done_ = std::vector<Counter>(phases_.size());
}

void PhasedJob::participate(int participant) {
  const bool stamp = participant == 0 && PhaseProfile::enabled();
  int64_t phase_start = stamp ? now_ns() : 0;
  for (size_t p = 0; p < phases_.size(); ++p) {
    if (p > 0) {
      const int64_t needed = phases_[p - 1].chunks;
      wait_until([&] { return done_[p - 1].value.load(std::memory_order_acquire) >= needed; });
      if (stamp) {
        const int64_t t = now_ns();
        PhaseProfile::add(phases_[p - 1].label, t - phase_start, phases_[p - 1].bytes);
        phase_start = t;
      }
    }
    const Phase& phase = phases_[p];
    for (int64_t chunk = claimed_[p].value.fetch_add(1, std::memory_order_relaxed);
         chunk < phase.chunks; chunk = claimed_[p].value.fetch_add(1, std::memory_order_relaxed)) {
      phase.run(chunk, participant);
      done_[p].value.fetch_add(1, std::memory_order_acq_rel);
    }
  }
  if (stamp && !phases_.empty()) {  // the last phase: until every chunk of it is done
    const int64_t needed = phases_.back().chunks;
    wait_until([&] { return done_.back().value.load(std::memory_order_acquire) >= needed; });
    PhaseProfile::add(phases_.back().label, now_ns() - phase_start, phases_.back().bytes);
  }
}

WorkerPool& WorkerPool::instance() {
  static std::once_flag registered;
  std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  if (g_pool == nullptr) g_pool = new WorkerPool(std::max(1, at::get_num_threads()));
  return *g_pool;
}

WorkerPool::WorkerPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
}

WorkerPool::~WorkerPool() {
  stopping_.store(true);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

// Set on the pool's workers and on a caller while its job runs: a kernel called from inside a
// job runs on its own thread instead of waiting for the pool it is part of.
thread_local bool t_inside_job = false;

void WorkerPool::run(PhasedJob& job, int threads) {
  threads = std::min(threads, max_threads());
  job.prepare();
  if (threads <= 1 || t_inside_job) {
    job.participate(0);
    return;
  }
  // The kernels run without the GIL, so Python threads may call them at once: one job at a time.
  std::lock_guard<std::mutex> one_job(submit_mutex_);
  struct Inside {
    Inside() { t_inside_job = true; }
    ~Inside() { t_inside_job = false; }
  } inside;
  job_ = &job;
  job_threads_ = threads;
  state_.store(0, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
  job.participate(0);
  state_.fetch_or(kClosed, std::memory_order_acq_rel);
  wait_until([&] { return (state_.load(std::memory_order_acquire) & ~kClosed) == 0; });
}

void WorkerPool::work(int index) {
  t_inside_job = true;
  uint64_t seen = generation_.load(std::memory_order_acquire);
  while (!stopping_.load(std::memory_order_acquire)) {
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && spins < kIdleSpins) {
      pause();
      ++spins;
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(mutex_);
      sleeping_.fetch_add(1);
      wake_.wait(lock, [&] {
        return generation_.load(std::memory_order_acquire) != seen || stopping_.load();
      });
      sleeping_.fetch_sub(1);
    }
    if (stopping_.load()) return;
    // Join only a job that is still open: once the caller closed it, it waits for nobody new.
    uint32_t state = state_.load(std::memory_order_acquire);
    bool joined = false;
    while (!(state & kClosed)) {
      if (state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel)) {
        joined = true;
        break;
      }
    }
    seen = generation_.load(std::memory_order_acquire);
    if (!joined) continue;
    if (index < job_threads_) job_->participate(index);
    state_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void parallel_chunks(int64_t chunks, const std::function<void(int64_t, int)>& fn, int threads,
                     const char* label, int64_t bytes) {
  PhasedJob job;
  job.add_phase(chunks, fn, label, bytes);
  const int wanted = threads > 0 ? threads : team_size();
  WorkerPool::instance().run(job, static_cast<int>(std::min<int64_t>(wanted, chunks)));
}

}  // namespace tokenmill
