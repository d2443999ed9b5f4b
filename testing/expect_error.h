// Test helper: assert that a call fails with a c10::Error whose message names what it should.
#pragma once

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>

namespace memlean::testing {

// Runs f, which must throw a c10::Error (TORCH_CHECK) whose message contains `needle`.
template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    std::forward<F>(f)();
    ADD_FAILURE() << "expected an error containing: " << needle;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "error message does not contain \"" << needle << "\":\n"
        << e.what();
  }
}

}  // namespace memlean::testing
