#pragma once
// Writing a whole text file (stats JSON, a trace, a timeline SVG) in one call.
#include <string>
#include <string_view>

namespace sluice {

// Writes `text` to `path`, replacing what was there. Throws FileError naming `what` (e.g.
// "trace") and the path, with the system's reason, when it cannot be opened or written.
void write_text_file(const std::string& path, std::string_view text, std::string_view what);

}  // namespace sluice
