#include "runtime/text_file.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "runtime/error.h"

namespace sluice {

void write_text_file(const std::string& path, std::string_view text, std::string_view what) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr)
    throw FileError("cannot open " + std::string(what) + " file '" + path + "' for writing: " + std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int err = errno;
  if (std::fclose(f) != 0 || !written)
    throw FileError("cannot write " + std::string(what) + " file '" + path + "': " + std::strerror(written ? errno : err));
}

}  // namespace sluice
