// mla-bench: result rows, the printed table and the JSON file.
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "bench.hpp"

namespace mla::bench {

struct Row {
  BenchCase c;
  std::string kernel;
  double time_us = 0;
  double tflops = 0;
  double gbps = 0;
  std::optional<double> frac_gemm;         // tflops / ceilings.gemm_tflops
  std::optional<double> frac_copy;         // gbps / ceilings.copy_gbps
  std::optional<double> speedup_vs_naive;  // naive time / this kernel's time
  std::optional<double> plan_us;           // plan_decode, median (not part of time_us)
  std::optional<double> graph_us;          // the timed call replayed from a CUDA graph, median
  std::optional<double> plan_graph_us;     // plan_decode replayed from a CUDA graph, median
  double max_rel_err = 0;
  double tolerance = 0;
  int64_t rows_checked = 0;
  int64_t non_finite = 0;                  // NaN / inf output elements (any makes verified false)
  bool verified = false;
  std::string error;  // set when the case could not run
};

struct Report {
  std::string device;   // "cpu" / "cuda"
  std::string card;
  std::string driver;   // empty: not applicable
  std::string commit;
  std::optional<Ceilings> ceilings;
  std::string sweep;    // sweep name, or "single"
  std::string part;     // "K/N" when only a slice of the cases ran (--part), else empty
  int warmup = 0;
  int iters = 0;
  std::string flush;    // cuda: the L2 flush before each run ("write" / "read" / "none"), else empty
  std::vector<Row> rows;
};

void print_header(std::FILE* f, const Report& report);
void print_table_head(std::FILE* f, bool with_ceilings);
void print_row(std::FILE* f, const Row& row, bool with_ceilings);
// Writes the report as JSON; throws mla::Error when the file cannot be written.
void write_json(const std::string& path, const Report& report);

}  // namespace mla::bench
