// Model cache: filled in by the cache issue.
namespace sluice::cache {}
