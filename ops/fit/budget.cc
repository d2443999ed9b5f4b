// memlean::fit budgets: parsing and printing byte counts.
#include "ops/fit/budget.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace memlean::fit {
namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

[[noreturn]] void bad(const std::string& argument, const std::string& text, const std::string& why) {
  throw std::invalid_argument(argument + ": " + why + ", got '" + text +
                              "' (write bytes as a positive number with an optional unit: "
                              "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; e.g. '6GiB', '512MiB', "
                              "'2.5GB')");
}

}  // namespace

int64_t parse_budget(const std::string& text, const std::string& argument) {
  const std::string s = trim(text);
  if (s.empty()) bad(argument, text, "empty");
  size_t i = 0;
  if (s[i] == '+' || s[i] == '-') ++i;
  bool digits = false;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) {
    digits = digits || s[i] != '.';
    ++i;
  }
  if (!digits) bad(argument, text, "no number");
  const std::string number = s.substr(0, i);
  if (number.find('.') != number.rfind('.')) bad(argument, text, "not a number");
  const std::string unit = lower(trim(s.substr(i)));
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1.0},          {"b", 1.0},          {"kb", 1e3},           {"mb", 1e6},
      {"gb", 1e9},        {"tb", 1e12},        {"kib", 1024.0},       {"mib", 1048576.0},
      {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
  double scale = 0;
  for (const auto& [name, value] : kUnits) {
    if (unit == name) scale = value;
  }
  if (scale == 0) bad(argument, text, "unknown unit '" + unit + "'");
  if (number.find('.') == std::string::npos) {
    // A whole number: exact in integers (a double holds whole numbers exactly only up to 2^53,
    // and rounds 2^63 - 1 up to 2^63). Every unit is a whole number of bytes.
    if (number[0] == '-') bad(argument, text, "a negative budget");
    const char* first = number.data() + (number[0] == '+' ? 1 : 0);  // (from_chars: no '+')
    const char* last = number.data() + number.size();
    int64_t count = 0;
    const std::from_chars_result read = std::from_chars(first, last, count);
    int64_t bytes = 0;
    if (read.ec == std::errc::result_out_of_range ||
        __builtin_mul_overflow(count, static_cast<int64_t>(scale), &bytes)) {
      bad(argument, text, "more than int64 bytes");
    }
    if (read.ec != std::errc() || read.ptr != last) bad(argument, text, "not a number");
    if (bytes < 1) bad(argument, text, "a budget must be at least one byte");
    return bytes;
  }
  char* end = nullptr;
  const double value = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size() || !std::isfinite(value)) bad(argument, text, "not a number");
  if (value < 0) bad(argument, text, "a negative budget");
  const double bytes = std::floor(value * scale);
  if (bytes >= 9.2233720368547758e18) bad(argument, text, "more than int64 bytes");
  if (bytes < 1) bad(argument, text, "a budget must be at least one byte");
  return static_cast<int64_t>(bytes);
}

int64_t check_budget(int64_t bytes, const std::string& argument) {
  if (bytes <= 0) {
    throw std::invalid_argument(argument + " must be > 0 bytes, got " + std::to_string(bytes));
  }
  return bytes;
}

int64_t cuda_margin(int64_t budget_bytes) {
  return std::max<int64_t>(int64_t{2} << 20, budget_bytes / 400);
}

std::string describe_bytes(int64_t bytes) {
  std::string digits = std::to_string(bytes < 0 ? -bytes : bytes);
  std::string grouped;
  for (size_t k = 0; k < digits.size(); ++k) {
    if (k > 0 && (digits.size() - k) % 3 == 0) grouped += ',';
    grouped += digits[k];
  }
  char gib[64];
  std::snprintf(gib, sizeof gib, "%.2f", static_cast<double>(bytes) / 1073741824.0);
  return (bytes < 0 ? "-" : "") + grouped + " bytes (" + gib + " GiB)";
}

}  // namespace memlean::fit
