// Text formats of memstats' reports (Tracker::csv/json, Categories::json), shared with the
// programs that write reports of their own around them (the trainer's JSON report).
#pragma once

#include <string>

namespace memlean::memstats {

// `s` as a JSON string literal, quotes included (", \, control characters escaped).
std::string json_string(const std::string& s);

// `v` as a JSON number ("%.10g"), or null when it is not finite.
std::string json_number(double v);

// `s` as one CSV field: as it is, or quoted (with "" for ") when it holds , " or a newline.
std::string csv_field(const std::string& s);

}  // namespace memlean::memstats
