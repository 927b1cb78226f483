// mla-bench: the printed table and the hand-written JSON report.
#include "report.hpp"

#include <cmath>
#include <fstream>
#include <sstream>

#include "mla/error.hpp"

namespace mla::bench {

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    const unsigned char u = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (u < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", u);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

// JSON has no NaN or infinity: those become null.
std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

std::string json_number(const std::optional<double>& x) {
  return x ? json_number(*x) : std::string("null");
}

std::string json_string_or_null(const std::string& s) { return s.empty() ? "null" : json_string(s); }

// Mean sequence length of a prefill case (its "kv_len" and "q_len" in the table).
int64_t prefill_mean_len(const BenchCase& c) { return (c.tokens + c.batch / 2) / c.batch; }

std::string optional_cell(const std::optional<double>& x, const char* format) {
  if (!x) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, format, *x);
  return buf;
}

}  // namespace

void print_header(std::FILE* f, const Report& r) {
  std::fprintf(f, "mla-bench: device %s (%s%s%s), commit %s\n", r.device.c_str(), r.card.c_str(),
               r.driver.empty() ? "" : ", driver ", r.driver.c_str(), r.commit.c_str());
  if (r.ceilings)
    std::fprintf(f, "ceilings: cuBLAS bf16 GEMM %.1f TFLOP/s, device copy %.1f GB/s, launch floor %.1f us\n",
                 r.ceilings->gemm_tflops, r.ceilings->copy_gbps, r.ceilings->launch_floor_us);
  std::fprintf(f, "sweep %s%s%s, %d warm-up + %d timed iterations (median%s%s); prefill rows show the "
                  "mean sequence length as kv_len/q_len\n",
               r.sweep.c_str(), r.part.empty() ? "" : " part ", r.part.c_str(), r.warmup, r.iters,
               r.flush.empty() ? "" : ", L2 flush by ", r.flush.c_str());
}

void print_table_head(std::FILE* f, bool with_ceilings) {
  std::fprintf(f, "%-8s %-16s %5s %5s %6s %5s %4s %-8s %11s %8s %8s", "op", "kernel", "heads",
               "batch", "kv_len", "q_len", "page", "dtype", "time_us", "TFLOP/s", "GB/s");
  if (with_ceilings) std::fprintf(f, " %9s %9s %8s", "frac_gemm", "frac_copy", "speedup");
  std::fprintf(f, " %11s\n", "max_rel_err");
  std::fflush(f);
}

void print_row(std::FILE* f, const Row& row, bool with_ceilings) {
  const BenchCase& c = row.c;
  const bool decode = c.op == Op::kDecode;
  const int64_t kv_len = decode ? c.kv_len : prefill_mean_len(c);
  const int64_t q_len = decode ? c.q_len : prefill_mean_len(c);
  const std::string page = decode ? std::to_string(c.page_size) : "-";
  // The cache's dtype, and the query's after a slash where it differs (--q-dtype).
  std::string dtype_label(dtype_name(c.kv_dtype));
  if (c.q_dtype) dtype_label.append("/").append(dtype_name(*c.q_dtype));
  std::fprintf(f, "%-8s %-16s %5d %5d %6lld %5lld %4s %-8s", op_name(c.op), row.kernel.c_str(),
               c.heads, c.batch, static_cast<long long>(kv_len), static_cast<long long>(q_len),
               page.c_str(), dtype_label.c_str());
  if (!row.error.empty()) {
    std::fprintf(f, "  ERROR: %s\n", row.error.c_str());
    std::fflush(f);
    return;
  }
  std::fprintf(f, " %11.1f %8.3f %8.1f", row.time_us, row.tflops, row.gbps);
  if (with_ceilings)
    std::fprintf(f, " %9s %9s %8s", optional_cell(row.frac_gemm, "%.3f").c_str(),
                 optional_cell(row.frac_copy, "%.3f").c_str(),
                 optional_cell(row.speedup_vs_naive, "%.2fx").c_str());
  std::fprintf(f, " %11.2e", row.max_rel_err);
  if (row.plan_us) std::fprintf(f, "  (plan %.1f us)", *row.plan_us);
  if (row.graph_us) std::fprintf(f, "  (graph %.1f us)", *row.graph_us);
  std::fprintf(f, "%s\n", row.verified ? "" : "  FAILED verification");
  std::fflush(f);
}

void write_json(const std::string& path, const Report& r) {
  std::ostringstream os;
  os << "{\n";
  os << "  \"card\": " << json_string(r.card) << ",\n";
  os << "  \"driver\": " << json_string_or_null(r.driver) << ",\n";
  os << "  \"commit\": " << json_string(r.commit) << ",\n";
  os << "  \"device\": " << json_string(r.device) << ",\n";
  os << "  \"sweep\": " << json_string(r.sweep) << ",\n";
  if (!r.part.empty()) os << "  \"part\": " << json_string(r.part) << ",\n";
  os << "  \"warmup\": " << r.warmup << ",\n";
  os << "  \"iters\": " << r.iters << ",\n";
  if (!r.flush.empty()) os << "  \"flush\": " << json_string(r.flush) << ",\n";
  os << "  \"ceilings\": {\"gemm_tflops\": "
     << (r.ceilings ? json_number(r.ceilings->gemm_tflops) : "null")
     << ", \"copy_gbps\": " << (r.ceilings ? json_number(r.ceilings->copy_gbps) : "null")
     << ", \"launch_floor_us\": " << (r.ceilings ? json_number(r.ceilings->launch_floor_us) : "null")
     << "},\n";
  os << "  \"rows\": [";
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const Row& row = r.rows[i];
    const BenchCase& c = row.c;
    const bool decode = c.op == Op::kDecode;
    const bool ran = row.error.empty();
    os << (i ? ",\n" : "\n") << "    {";
    os << "\"op\": " << json_string(op_name(c.op));
    os << ", \"kernel\": " << json_string(row.kernel);
    os << ", \"heads\": " << c.heads;
    os << ", \"batch\": " << c.batch;
    os << ", \"kv_len\": " << (decode ? int64_t(c.kv_len) : prefill_mean_len(c));
    if (decode && c.kv_min >= 0) os << ", \"kv_min\": " << c.kv_min;  // mixed lengths only
    os << ", \"q_len\": " << (decode ? int64_t(c.q_len) : prefill_mean_len(c));
    os << ", \"page_size\": " << (decode ? std::to_string(c.page_size) : "null");
    os << ", \"kv_dtype\": " << json_string(std::string(dtype_name(c.kv_dtype)));
    if (c.q_dtype) os << ", \"q_dtype\": " << json_string(std::string(dtype_name(*c.q_dtype)));
    os << ", \"tokens\": " << (decode ? int64_t(c.batch) * c.q_len : c.tokens);
    os << ", \"time_us\": " << (ran ? json_number(row.time_us) : "null");
    os << ", \"tflops\": " << (ran ? json_number(row.tflops) : "null");
    os << ", \"gbps\": " << (ran ? json_number(row.gbps) : "null");
    os << ", \"frac_gemm\": " << json_number(row.frac_gemm);
    os << ", \"frac_copy\": " << json_number(row.frac_copy);
    os << ", \"speedup_vs_naive\": " << json_number(row.speedup_vs_naive);
    os << ", \"plan_us\": " << json_number(row.plan_us);
    os << ", \"graph_us\": " << json_number(row.graph_us);
    os << ", \"plan_graph_us\": " << json_number(row.plan_graph_us);
    os << ", \"max_rel_err\": " << (ran ? json_number(row.max_rel_err) : "null");
    os << ", \"tolerance\": " << json_number(row.tolerance);
    os << ", \"rows_checked\": " << row.rows_checked;
    os << ", \"non_finite\": " << row.non_finite;
    os << ", \"verified\": " << (row.verified ? "true" : "false");
    os << ", \"error\": " << json_string_or_null(row.error);
    os << "}";
  }
  os << (r.rows.empty() ? "]\n" : "\n  ]\n") << "}\n";
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  MLA_CHECK(file.good(), "mla-bench: cannot open --json file '", path, "' for writing");
  file << os.str();
  file.close();
  MLA_CHECK(file.good(), "mla-bench: writing --json file '", path, "' failed");
}

}  // namespace mla::bench
