// mla-bench: times DeepSeek-V3-shaped MLA decode (absorbed, over a paged latent cache) and ragged
// causal prefill through the public ops, verifies every result against a float64 naive
// computation, and prints a table (optionally a JSON file). See `mla-bench --help`.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench.hpp"
#include "mla/error.hpp"
#include "report.hpp"

#ifndef MLA_BENCH_COMMIT
#define MLA_BENCH_COMMIT "unknown"
#endif

namespace mla::bench {
namespace {

constexpr const char* kUsage = R"(usage: mla-bench [options]

Times MLA decode (absorbed: q [T,H,576] over a paged latent cache [P,S,576], out [T,H,512]) and
ragged causal prefill (q/k 192, v 128) through the public mla ops, on random inputs, and checks
each result against a float64 naive computation. Without case options it runs --sweep default.

  --device auto|cpu|cuda   where to run (auto: cuda when built with CUDA and a GPU is present)
  --op decode|prefill|all  which ops (default all; also filters a sweep)
  --sweep NAME             default  a small decode + prefill set (seconds on a CPU)
                           decode   batch {1,16,64,128,256} x heads {16,128} x kv_len {1k,4k,16k}
                                    x q_len {1,2}, page 64, bf16 and fp8
                           prefill  tokens {1k,8k,32k} x heads {16,128}, about 4k tokens a request
  --batch N                requests (default 4)
  --heads N                query heads, 1..128 (default 16)
  --kv-len N               decode: cached tokens per request, new ones included (default 1024)
  --kv-min N               decode: mixed lengths, each request's drawn uniformly from
                           [N, --kv-len] (default: every request --kv-len)
  --q-len N                decode: queries per request (default 1)
  --page-size N            decode: tokens per page, a power of two 1..128 (default 64)
  --kv-dtype bf16|fp16|fp8 decode: cache and query dtype; prefill: q/k/v dtype (default bf16)
  --q-dtype bf16|fp16|fp8  decode: the query's dtype, where it differs from --kv-dtype (an fp8
                           cache with a 16-bit query)
  --tokens N               prefill: total new tokens, split raggedly over --batch requests
                           (default 1024)
  --flush write|read|none  cuda: how the L2 is emptied before each run: write (default) fills a
                           buffer of twice the L2 size, which leaves the L2 full of dirty lines
                           that the timed run's traffic must write back first; read reads such a
                           buffer, which leaves clean lines; none leaves in L2 what the previous
                           run left there (its inputs, its outputs and the kernels' code)
  --deterministic on|off   cuda decode: also time mla_decode's deterministic mode (unsplit
                           64-row tiles; rows named '...-deterministic'; default off)
  --split-keys N           cuda decode: with the deterministic rows, also time the mode on a
                           deterministic schedule that cuts every request's keys every N keys
                           (a positive multiple of 64; rows '...-deterministic-split'; default 0:
                           none)
  --rows LIST              cuda decode: the rows to time, a comma-separated list of portable
                           (mla-sm80-mma), hopper (mla-sm90-wgmma), unsplit (the kernel picked
                           without a schedule), deterministic and naive (naive-cublas); default
                           portable,hopper,unsplit,naive (plus deterministic with --deterministic
                           on)
  --warmup N               untimed runs per case (default 1 on cpu, 5 on cuda)
  --iters N                timed runs per case; the median is reported (default 3 / 20)
  --seed N                 random seed (default 1)
  --part K/N               run only the K-th of N consecutive slices of the cases (1 <= K <= N),
                           with the seeds of the whole run, so that the parts of a long sweep
                           can run separately and be merged (bench/merge_results.py)
  --json FILE              also write the results as JSON
  --help                   this text

Exit status: 0 when every case ran and verified, 1 when a case failed, 2 on bad options.
)";

struct Options {
  std::string device = "auto";
  std::string op = "all";
  std::string sweep;
  std::string json_path;
  BenchCase single;
  bool case_options_given = false;
  std::string flush = "write";
  bool deterministic_rows = false;
  int split_keys = 0;  // --split-keys
  std::optional<DecodeRows> rows;  // --rows
  int warmup = -1;
  int iters = -1;
  uint64_t seed = 1;
  int part_index = 1;  // --part K/N
  int part_count = 1;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "mla-bench: %s\n(run mla-bench --help for the options)\n", message.c_str());
  std::exit(2);
}

int64_t parse_int(std::string_view option, std::string_view text, int64_t lo, int64_t hi) {
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < lo || value > hi)
    usage_error(std::string(option) + " expects an integer in [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "], got '" + std::string(text) + "'");
  return value;
}

DType parse_dtype(std::string_view option, std::string_view text) {
  if (text == "bf16") return DType::kBF16;
  if (text == "fp16") return DType::kFP16;
  if (text == "fp8" || text == "fp8e4m3") return DType::kFP8E4M3;
  usage_error(std::string(option) + " expects bf16, fp16 or fp8, got '" + std::string(text) + "'");
}

// --rows: the decode rows named in a comma-separated list (none: not a valid list).
std::optional<DecodeRows> parse_rows(std::string_view list) {
  DecodeRows rows;
  rows.portable = rows.hopper = rows.unsplit = rows.deterministic = rows.naive = false;
  while (true) {
    const size_t comma = list.find(',');
    const std::string_view name = list.substr(0, comma);
    bool* row = name == "portable"        ? &rows.portable
                : name == "hopper"        ? &rows.hopper
                : name == "unsplit"       ? &rows.unsplit
                : name == "deterministic" ? &rows.deterministic
                : name == "naive"         ? &rows.naive
                                          : nullptr;
    if (row == nullptr) return std::nullopt;
    *row = true;
    if (comma == std::string_view::npos) return rows;
    list.remove_prefix(comma + 1);
  }
}

#if defined(MLA_WITH_CUDA)
// The decode rows the options ask for: --rows, or the default set; --deterministic on adds the
// deterministic mode's.
DecodeRows decode_rows(const Options& o) {
  DecodeRows rows = o.rows.value_or(DecodeRows{});
  if (o.deterministic_rows) rows.deterministic = true;
  rows.split_keys = o.split_keys;
  return rows;
}
#endif

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error("unknown option or missing value: '" + std::string(arg) + "'");
    const std::string_view value = argv[++i];
    constexpr int64_t kMax32 = (int64_t(1) << 31) - 1;
    if (arg == "--device") {
      if (value != "auto" && value != "cpu" && value != "cuda")
        usage_error("--device expects auto, cpu or cuda, got '" + std::string(value) + "'");
      o.device = value;
    } else if (arg == "--op") {
      if (value != "decode" && value != "prefill" && value != "all")
        usage_error("--op expects decode, prefill or all, got '" + std::string(value) + "'");
      o.op = value;
    } else if (arg == "--sweep") {
      if (value != "default" && value != "decode" && value != "prefill")
        usage_error("--sweep expects default, decode or prefill, got '" + std::string(value) + "'");
      o.sweep = value;
    } else if (arg == "--flush") {
      o.flush = value;
      if (o.flush != "write" && o.flush != "read" && o.flush != "none")
        usage_error("--flush expects write, read or none, got '" + std::string(value) + "'");
    } else if (arg == "--deterministic") {
      if (value != "on" && value != "off")
        usage_error("--deterministic expects on or off, got '" + std::string(value) + "'");
      o.deterministic_rows = value == "on";
    } else if (arg == "--split-keys") {
      o.split_keys = int(parse_int(arg, value, 0, kMax32));
      if (o.split_keys % 64 != 0)
        usage_error("--split-keys expects a multiple of 64, got '" + std::string(value) + "'");
    } else if (arg == "--rows") {
      o.rows = parse_rows(value);
      if (!o.rows)
        usage_error("--rows expects a comma-separated list of portable, hopper, unsplit, "
                    "deterministic and naive, got '" + std::string(value) + "'");
    } else if (arg == "--json") {
      o.json_path = value;
    } else if (arg == "--warmup") {
      o.warmup = int(parse_int(arg, value, 0, 1000000));
    } else if (arg == "--iters") {
      o.iters = int(parse_int(arg, value, 1, 1000000));
    } else if (arg == "--part") {
      const size_t slash = value.find('/');
      if (slash == std::string_view::npos) usage_error("--part expects K/N, got '" + std::string(value) + "'");
      o.part_count = int(parse_int("--part N", value.substr(slash + 1), 1, 1000000));
      o.part_index = int(parse_int("--part K", value.substr(0, slash), 1, o.part_count));
    } else if (arg == "--seed") {
      o.seed = uint64_t(parse_int(arg, value, 0, INT64_MAX));
    } else {
      o.case_options_given = true;
      if (arg == "--batch") o.single.batch = int(parse_int(arg, value, 1, kMax32));
      else if (arg == "--heads") o.single.heads = int(parse_int(arg, value, 1, kMaxHeads));
      else if (arg == "--kv-len") o.single.kv_len = int(parse_int(arg, value, 0, kMax32));
      else if (arg == "--kv-min") o.single.kv_min = int(parse_int(arg, value, 0, kMax32));
      else if (arg == "--q-len") o.single.q_len = int(parse_int(arg, value, 1, kMax32));
      else if (arg == "--page-size") o.single.page_size = int(parse_int(arg, value, 1, kMaxPageSize));
      else if (arg == "--kv-dtype") o.single.kv_dtype = parse_dtype(arg, value);
      else if (arg == "--q-dtype") o.single.q_dtype = parse_dtype(arg, value);
      else if (arg == "--tokens") o.single.tokens = parse_int(arg, value, 1, kMax32);
      else usage_error("unknown option '" + std::string(arg) + "'");
    }
  }
  if (!o.sweep.empty() && o.case_options_given)
    usage_error("--sweep and the single-case options (--batch, --heads, ...) are exclusive");
  if (o.sweep.empty() && !o.case_options_given) o.sweep = "default";
  if (o.single.kv_min > o.single.kv_len)
    usage_error("--kv-min " + std::to_string(o.single.kv_min) + " is past --kv-len " +
                std::to_string(o.single.kv_len));
  if (o.split_keys > 0 && !o.deterministic_rows && !(o.rows && o.rows->deterministic))
    usage_error("--split-keys times the deterministic rows: give --deterministic on (or "
                "deterministic in --rows)");
  return o;
}

BenchCase decode_case(int batch, int heads, int kv_len, int q_len, int page_size, DType dtype) {
  BenchCase c;
  c.op = Op::kDecode;
  c.batch = batch;
  c.heads = heads;
  c.kv_len = kv_len;
  c.q_len = q_len;
  c.page_size = page_size;
  c.kv_dtype = dtype;
  return c;
}

BenchCase prefill_case(int64_t tokens, int batch, int heads, DType dtype) {
  BenchCase c;
  c.op = Op::kPrefill;
  c.tokens = tokens;
  c.batch = batch;
  c.heads = heads;
  c.kv_dtype = dtype;
  return c;
}

std::vector<BenchCase> sweep_cases(const std::string& name) {
  std::vector<BenchCase> cases;
  if (name == "default") {
    // Small enough for a CPU: a few decode shapes (both head regimes, q_len 1 and 2, page sizes
    // 1..64, odd lengths, every cache dtype) and ragged prefill.
    cases.push_back(decode_case(4, 16, 1024, 1, 64, DType::kBF16));
    cases.push_back(decode_case(2, 128, 128, 2, 64, DType::kFP8E4M3));
    cases.push_back(decode_case(3, 16, 999, 1, 16, DType::kFP16));
    cases.push_back(decode_case(4, 8, 257, 2, 1, DType::kBF16));
    cases.push_back(prefill_case(256, 2, 16, DType::kBF16));
    cases.push_back(prefill_case(301, 3, 8, DType::kFP16));
  } else if (name == "decode") {
    for (DType dtype : {DType::kBF16, DType::kFP8E4M3})
      for (int heads : {16, 128})
        for (int batch : {1, 16, 64, 128, 256})
          for (int kv_len : {1024, 4096, 16384})
            for (int q_len : {1, 2}) cases.push_back(decode_case(batch, heads, kv_len, q_len, 64, dtype));
  } else if (name == "prefill") {
    for (int heads : {16, 128})
      for (int64_t tokens : {1024, 8192, 32768})
        cases.push_back(prefill_case(tokens, int(std::max<int64_t>(1, tokens / 4096)), heads, DType::kBF16));
  }
  return cases;
}

std::string commit_id() {
  const char* env = std::getenv("MLA_BENCH_COMMIT");
  return env && *env ? std::string(env) : std::string(MLA_BENCH_COMMIT);
}

// Runs one case: generate inputs, time every kernel, verify every output, fill the rows.
std::vector<Row> run_case(Runner& runner, const BenchCase& c, int warmup, int iters,
                         uint64_t seed, const std::optional<Ceilings>& ceilings) {
  std::vector<Measurement> measured;
  std::vector<Verification> checks;
  Work work;
  if (c.op == Op::kDecode) {
    const DecodeProblem p = make_decode_problem(c, seed);
    work = decode_work(p);
    measured = runner.run_decode(p, warmup, iters);
    for (const Measurement& m : measured) {
      if (!m.error.empty()) {  // nothing to verify
        checks.emplace_back();
        continue;
      }
      checks.push_back(verify_decode(p, m.out, seed));
      if (m.graph_out) checks.back().merge(verify_decode(p, *m.graph_out, seed));
      // The naive baseline computes in bf16 whatever the input dtype.
      if (m.is_baseline)
        checks.back().tolerance = std::max(checks.back().tolerance, tolerance_for(DType::kBF16));
    }
  } else {
    const PrefillProblem p = make_prefill_problem(c, seed);
    work = prefill_work(p);
    measured = runner.run_prefill(p, warmup, iters);
    for (const Measurement& m : measured)
      checks.push_back(m.error.empty() ? verify_prefill(p, m.out, seed) : Verification{});
  }
  std::optional<double> naive_us;  // a baseline that failed its check is no baseline
  for (size_t i = 0; i < measured.size(); ++i)
    if (measured[i].is_baseline && measured[i].error.empty() && checks[i].passed())
      naive_us = measured[i].time_us;
  std::vector<Row> rows;
  for (size_t i = 0; i < measured.size(); ++i) {
    const Measurement& m = measured[i];
    Row row;
    row.c = c;
    row.kernel = m.kernel;
    if (!m.error.empty()) {
      row.error = m.error;
      rows.push_back(std::move(row));
      continue;
    }
    row.time_us = m.time_us;
    row.plan_us = m.plan_us;
    row.graph_us = m.graph_us;
    row.plan_graph_us = m.plan_graph_us;
    row.tflops = work.flops / (m.time_us * 1e-6) / 1e12;
    row.gbps = work.bytes / (m.time_us * 1e-6) / 1e9;
    if (ceilings) {
      row.frac_gemm = row.tflops / ceilings->gemm_tflops;
      row.frac_copy = row.gbps / ceilings->copy_gbps;
      if (naive_us && !m.is_baseline) row.speedup_vs_naive = *naive_us / m.time_us;
    }
    row.max_rel_err = checks[i].max_rel_err;
    row.tolerance = checks[i].tolerance;
    row.rows_checked = checks[i].rows_checked;
    row.non_finite = checks[i].non_finite;
    row.verified = checks[i].passed();
    rows.push_back(std::move(row));
  }
  return rows;
}

int run(int argc, char** argv) {
  const Options o = parse_options(argc, argv);

  std::unique_ptr<Runner> runner;
  if (o.device == "cpu") {
    runner = make_cpu_runner();
  } else {
#if defined(MLA_WITH_CUDA)
    if (o.device == "cuda" || cuda_device_available())
      runner = make_cuda_runner(o.flush == "read"   ? L2Flush::kRead
                                : o.flush == "none" ? L2Flush::kNone
                                                    : L2Flush::kWrite,
                                decode_rows(o));
#else
    if (o.device == "cuda") usage_error("--device cuda: this mla-bench was built without CUDA");
#endif
    if (!runner) runner = make_cpu_runner();
  }
  const bool on_cpu = runner->device() == "cpu";
  if (on_cpu && (o.rows || o.flush != "write" || o.deterministic_rows || o.split_keys > 0))
    std::fprintf(stderr, "mla-bench: --rows, --flush, --deterministic and --split-keys choose "
                         "CUDA rows and timing; this run is on the CPU and ignores them\n");
  const int warmup = o.warmup >= 0 ? o.warmup : (on_cpu ? 1 : 5);
  const int iters = o.iters >= 1 ? o.iters : (on_cpu ? 3 : 20);

  std::vector<BenchCase> cases;
  if (!o.sweep.empty()) {
    cases = sweep_cases(o.sweep);
  } else {
    BenchCase decode = o.single, prefill = o.single;
    decode.op = Op::kDecode;
    prefill.op = Op::kPrefill;
    prefill.q_dtype.reset();  // prefill: --kv-dtype is every input's dtype
    cases = {decode, prefill};
  }
  // The cases --op selects, by their index in the whole list (a case's seed follows it).
  std::vector<size_t> selected;
  for (size_t i = 0; i < cases.size(); ++i)
    if (o.op == "all" || o.op == op_name(cases[i].op)) selected.push_back(i);
  if (selected.empty()) usage_error("--op " + o.op + " selects no case of --sweep " + o.sweep);

  // The slice of the selected cases this run covers.
  const size_t first = selected.size() * size_t(o.part_index - 1) / size_t(o.part_count);
  const size_t last = selected.size() * size_t(o.part_index) / size_t(o.part_count);
  if (first == last)
    usage_error("--part " + std::to_string(o.part_index) + "/" + std::to_string(o.part_count) +
                " selects none of the " + std::to_string(selected.size()) + " cases");

  Report report;
  report.device = runner->device();
  report.card = runner->card();
  report.driver = runner->driver();
  report.commit = commit_id();
  report.sweep = o.sweep.empty() ? "single" : o.sweep;
  if (o.part_count > 1)
    report.part = std::to_string(o.part_index) + "/" + std::to_string(o.part_count);
  report.warmup = warmup;
  report.iters = iters;
  if (report.device == "cuda") report.flush = o.flush;
  report.ceilings = runner->ceilings();
  print_header(stdout, report);
  print_table_head(stdout, report.ceilings.has_value());

  bool all_ok = true;
  for (size_t j = first; j < last; ++j) {
    const size_t i = selected[j];
    const BenchCase& c = cases[i];
    if (selected.size() > 1) {
      std::fprintf(stderr, "[%zu/%zu] %s ...\n", j + 1, selected.size(), describe(c).c_str());
      std::fflush(stderr);
    }
    std::vector<Row> rows;
    try {
      rows = run_case(*runner, c, warmup, iters, o.seed * 1000003u + i, report.ceilings);
    } catch (const std::exception& e) {
      Row row;
      row.c = c;
      row.kernel = "mla-" + report.device;
      row.error = e.what();
      rows = {row};
    }
    if (rows.empty() && o.sweep.empty()) {
      // A single case whose --rows name no kernel that applies to it (e.g. hopper where the
      // Hopper kernel does not run): nothing was measured, which is a failure, not a result.
      std::fprintf(stderr, "mla-bench: none of the selected kernels (--rows) applies to %s\n",
                   describe(c).c_str());
      all_ok = false;
    }
    for (Row& row : rows) {
      all_ok = all_ok && row.error.empty() && row.verified;
      print_row(stdout, row, report.ceilings.has_value());
      report.rows.push_back(std::move(row));
    }
  }
  if (!o.json_path.empty()) write_json(o.json_path, report);
  if (!all_ok) std::fprintf(stderr, "mla-bench: some cases failed (see the table above)\n");
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace mla::bench

int main(int argc, char** argv) {
  try {
    return mla::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mla-bench: %s\n", e.what());
    return 1;
  }
}
