// memlean::fit budgets: "6GiB", "512MiB", "2.5GB", "1000000" -> bytes. One parser for C++, the
// trainer's --memory_budget and Python's memlean.fit.
#pragma once

#include <cstdint>
#include <string>

namespace memlean::fit {

// Bytes of a budget written as a number with an optional unit: B, KB/MB/GB/TB (powers of
// 1000), KiB/MiB/GiB/TiB (powers of 1024); case-insensitive units, spaces allowed between
// number and unit; whole numbers exact up to int64's largest ("9223372036854775807"), fractions
// allowed ("2.5GB"), rounded down to a whole byte. Throws
// std::invalid_argument naming `argument` for an empty, negative, zero, non-finite or
// unparsable text, an unknown unit, or more than int64 bytes.
int64_t parse_budget(const std::string& text, const std::string& argument = "budget_bytes");

// Checks an integer budget: > 0, else std::invalid_argument naming `argument`.
int64_t check_budget(int64_t bytes, const std::string& argument = "budget_bytes");

// How far below a budget fit plans a step on CUDA: max(2 MiB, budget / 400). The caching
// allocator counts each allocation as the block it hands out, and which block that is depends
// on what its cache holds, i.e. on every step before: the same step of the same plan peaks a
// little differently in fit's measurement and in the caller's loop. Measured on an H100
// (torch 2.11, bf16 autocast, batch 128): a later step peaked up to 2.8 MB (0.09 %) above
// fit's own measurement of the plan (ResNet-50, 3.2 GB), and the least peak moved by 0.3 MB
// between two fit calls. (fit keeps no margin on the CPU, where the accounting is exact.)
int64_t cuda_margin(int64_t budget_bytes);

// "2,885,716,560 bytes (2.69 GiB)".
std::string describe_bytes(int64_t bytes);

}  // namespace memlean::fit
