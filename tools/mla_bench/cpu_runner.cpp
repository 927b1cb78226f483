// mla-bench: runs the ops on the CPU (wall-clock timing, median of the timed iterations).
#include <chrono>
#include <fstream>
#include <limits>
#include <thread>

#include "bench.hpp"

namespace mla::bench {

namespace {

std::string cpu_model_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
  }
  return "unknown CPU";
}

HostBuffer nan_output(DType dtype, std::vector<int64_t> shape) {
  HostBuffer out(dtype, std::move(shape));
  for (int64_t i = 0; i < out.numel(); ++i)
    store_from_float(out.data(), dtype, i, std::numeric_limits<float>::quiet_NaN());
  return out;
}

// Calls fn() warmup + iters times; returns the median of the timed calls in microseconds.
template <typename Fn>
double time_median_us(int warmup, int iters, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    const auto stop = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
  }
  return median(std::move(times));
}

class CpuRunner final : public Runner {
 public:
  std::string device() const override { return "cpu"; }
  std::string card() const override {
    return cpu_model_name() + " (" + std::to_string(std::thread::hardware_concurrency()) +
           " threads)";
  }
  std::string driver() const override { return ""; }
  std::optional<Ceilings> ceilings() override { return std::nullopt; }

  std::vector<Measurement> run_decode(const DecodeProblem& p, int warmup, int iters) override {
    Measurement m;
    m.kernel = "mla-cpu";
    m.out = nan_output(p.out_dtype, {p.num_tokens(), p.c.heads, kKvLoraRank});
    DecodeBuffers buffers;
    buffers.q = const_cast<void*>(p.q.data());
    buffers.kv_cache = const_cast<void*>(p.kv_cache.data());
    buffers.block_table = const_cast<int32_t*>(p.block_table.data());
    buffers.kv_lens = const_cast<int32_t*>(p.kv_lens.data());
    buffers.out = m.out.data();
    const MlaDecodeArgs args = decode_args(p, buffers, Device::cpu());
    m.time_us = time_median_us(warmup, iters, [&] { mla_decode(args); });
    return {std::move(m)};
  }

  std::vector<Measurement> run_prefill(const PrefillProblem& p, int warmup, int iters) override {
    Measurement m;
    m.kernel = "mla-cpu";
    m.out = nan_output(p.out_dtype, {p.c.tokens, p.c.heads, 128});
    PrefillBuffers buffers;
    buffers.q = const_cast<void*>(p.q.data());
    buffers.k = const_cast<void*>(p.k.data());
    buffers.v = const_cast<void*>(p.v.data());
    buffers.cu_seq_lens = const_cast<int32_t*>(p.cu_seq_lens.data());
    buffers.out = m.out.data();
    const MhaPrefillArgs args = prefill_args(p, buffers, Device::cpu());
    m.time_us = time_median_us(warmup, iters, [&] { mha_prefill(args); });
    return {std::move(m)};
  }
};

}  // namespace

std::unique_ptr<Runner> make_cpu_runner() { return std::make_unique<CpuRunner>(); }

}  // namespace mla::bench
