// mla::Error — the one exception type the library throws.
//
// Messages name the argument and what was expected versus what was given, and carry the file and
// line where the check failed, e.g.
//   "mla_decode: kv_cache.shape[2] must be 576 (kv_lora_rank 512 + rope 64), got 512
//    ([8, 64, 512] bf16 cpu) [src/tensor.cpp:94]"
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

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
// Message parts are formatted without iostreams (std::to_chars: no locale, no facets), so that
// a message can be built in any host process, whatever copy of the C++ runtime it has loaded.
inline void append_part(std::string& out, std::string_view text) { out.append(text); }
inline void append_part(std::string& out, const char* text) { out.append(text ? text : "(null)"); }
inline void append_part(std::string& out, char c) { out.push_back(c); }
inline void append_part(std::string& out, bool b) { out.append(b ? "true" : "false"); }
// Other pointers print as addresses (0x...), not through their conversion to bool.
template <typename T>
void append_part(std::string& out, const T* pointer) {
  char buf[2 + 2 * sizeof(uintptr_t)] = {'0', 'x'};
  const auto r = std::to_chars(buf + 2, buf + sizeof buf, reinterpret_cast<uintptr_t>(pointer), 16);
  out.append(buf, r.ptr);
}
inline void append_part(std::string& out, std::nullptr_t) { out.append("nullptr"); }
template <typename T>
  requires(std::is_arithmetic_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>)
void append_part(std::string& out, T value) {
  char buf[64];
  std::to_chars_result r;
  if constexpr (std::is_floating_point_v<T>) {
    // As printf's %g: 6 significant digits.
    r = std::to_chars(buf, buf + sizeof buf, value, std::chars_format::general, 6);
  } else {
    r = std::to_chars(buf, buf + sizeof buf, value);
  }
  out.append(buf, r.ptr);
}

template <typename... Args>
std::string format_message(const Args&... args) {
  std::string out;
  (append_part(out, args), ...);
  return out;
}

template <typename... Args>
[[noreturn]] void throw_error(const char* file, int line, const Args&... args) {
  throw Error(format_message(args...), file, line);
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
