// parallel_for: splits [0, n) into contiguous chunks over std::thread workers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace mla::cpu {

inline int num_worker_threads() {
  static const int n = std::max(1u, std::thread::hardware_concurrency());
  return n;
}

// Calls fn(i) for every i in [0, n). Exceptions from workers are rethrown on the caller.
template <typename Fn>
void parallel_for(int64_t n, Fn&& fn, int64_t min_per_thread = 1) {
  const int64_t threads =
      std::min<int64_t>(num_worker_threads(), std::max<int64_t>(1, n / std::max<int64_t>(1, min_per_thread)));
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
  std::vector<std::thread> workers;
  workers.reserve(size_t(threads));
  for (int64_t t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      try {
        for (int64_t i = n * t / threads; i < n * (t + 1) / threads; ++i) fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& w : workers) w.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace mla::cpu
