#pragma once
// Typed errors raised for caller mistakes and bad input. Every message names the
// file, tensor, module or flag at fault; the CLI prints what() as its one-line error.
#include <stdexcept>
#include <string>

namespace sluice {

// Base of every error sluice raises on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A file that cannot be opened, read or parsed (corrupt safetensors, bad JSON config).
class FileError : public Error {
 public:
  using Error::Error;
};

// A checkpoint whose keys or shapes do not match the model.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// A caller-supplied value that is out of range or malformed (flags, shapes, budgets).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A resource that could not be had (budget too small, allocation failed).
class ResourceError : public Error {
 public:
  using Error::Error;
};

// A host's request that a running call stop (a forward's layer callback threw it; Python's
// Ctrl-C becomes one): the call unwinds at the next layer boundary as from any error, and
// rethrows it.
class Interrupted : public Error {
 public:
  using Error::Error;
};

// A device operation that failed: a host->device copy that failed or timed out. The
// tensors it was writing hold unusable bytes; the caller drops them.
class DeviceError : public Error {
 public:
  using Error::Error;
};

}  // namespace sluice
