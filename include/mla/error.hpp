// mla::Error — the one exception type the library throws.
//
// Messages name the argument and what was expected versus what was given, and carry the file and
// line where the check failed, e.g.
//   "mla_decode: kv_cache.shape[2] must be 576 (kv_lora_rank 512 + rope 64), got 512 [src/ops/decode.cpp:88]"
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace mla {

class Error : public std::runtime_error {
 public:
  Error(const std::string& message, const char* file, int line)
      : std::runtime_error(message + " [" + file + ":" + std::to_string(line) + "]"),
        message_(message) {}
  // The message without the source location.
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

namespace detail {
inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append_all(os, rest...);
}
template <typename... Args>
[[noreturn]] void throw_error(const char* file, int line, const Args&... args) {
  std::ostringstream os;
  append_all(os, args...);
  throw Error(os.str(), file, line);
}
}  // namespace detail

}  // namespace mla

// MLA_FAIL("op: arg must be ", expected, ", got ", given) — throws mla::Error.
#define MLA_FAIL(...) ::mla::detail::throw_error(__FILE__, __LINE__, __VA_ARGS__)
// MLA_CHECK(cond, "message parts"...) — throws mla::Error when cond is false.
#define MLA_CHECK(cond, ...)                                     \
  do {                                                           \
    if (!(cond)) ::mla::detail::throw_error(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
