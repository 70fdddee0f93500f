#include "models/anima/block_layout.h"

#include <array>

#include "runtime/error.h"

namespace sluice::anima {
namespace {

constexpr std::array<int64_t, 3> kKnownDepths = {28, 40, 52};

// Note [Anima block layout]: where each base block sits in Anima-2.9B.
constexpr std::array<int64_t, 28> kBaseIn2p9 = {0,  1,  3,  4,  6,  7,  9,  10, 12, 13, 15, 16, 18, 19,
                                                20, 22, 23, 25, 26, 28, 29, 31, 32, 34, 35, 37, 38, 39};
// Where each Anima-2.9B block sits in Anima-3.8B.
constexpr std::array<int64_t, 40> k2p9In3p8 = {0,  1,  2,  4,  5,  6,  8,  9,  10, 12, 13, 14, 16, 17,
                                               18, 20, 21, 22, 24, 25, 26, 28, 29, 30, 32, 33, 34, 36,
                                               37, 38, 40, 41, 42, 44, 45, 46, 48, 49, 50, 51};

}  // namespace

int64_t adapter_source_depth(int64_t max_block_index) {
  for (int64_t d : kKnownDepths)
    if (d > max_block_index) return d;
  return -1;
}

std::vector<int64_t> block_positions(int64_t source_depth, int64_t model_depth) {
  if (source_depth == 28 && model_depth == 40) return {kBaseIn2p9.begin(), kBaseIn2p9.end()};
  if (source_depth == 40 && model_depth == 52) return {k2p9In3p8.begin(), k2p9In3p8.end()};
  if (source_depth == 28 && model_depth == 52) {
    std::vector<int64_t> out;
    out.reserve(kBaseIn2p9.size());
    for (int64_t p : kBaseIn2p9) out.push_back(k2p9In3p8[static_cast<size_t>(p)]);
    return out;
  }
  return {};
}

int64_t AdapterBlockMap::operator()(int64_t block) const {
  if (positions.empty()) return block;
  if (block < 0 || block >= static_cast<int64_t>(positions.size()))
    throw InvalidArgument("adapter block " + std::to_string(block) + " is outside the " +
                          std::to_string(positions.size()) + "-block layout it was mapped with");
  return positions[static_cast<size_t>(block)];
}

std::string AdapterBlockMap::describe(const std::string& what) const {
  std::string s = what + " was trained on a " + std::to_string(source_depth) +
                  "-block Anima: its blocks go to their measured positions in this " +
                  std::to_string(model_depth) + "-block model";
  // The first block that moves and the last one.
  size_t first = positions.size();
  for (size_t i = 0; i < positions.size(); ++i)
    if (positions[i] != static_cast<int64_t>(i)) {
      first = i;
      break;
    }
  if (first < positions.size()) {
    const size_t last = positions.size() - 1;
    s += " (block " + std::to_string(first) + " -> " + std::to_string(positions[first]);
    if (last != first) s += ", ..., " + std::to_string(last) + " -> " + std::to_string(positions[last]);
    s += ")";
  }
  return s + "; block_layout \"as-is\" (--adapter-blocks as-is) turns this off";
}

AdapterBlockMap map_adapter_blocks(int64_t max_block_index, int64_t model_depth, bool measured,
                                   const std::string& what) {
  AdapterBlockMap m;
  m.model_depth = model_depth;
  if (max_block_index < 0) return m;  // no block targets: nothing to map
  m.source_depth = adapter_source_depth(max_block_index);
  if (max_block_index >= model_depth) {
    const std::string trained =
        m.source_depth > 0 ? "trained on a " + std::to_string(m.source_depth) + "-block Anima"
                           : "deeper than any released Anima";
    throw CheckpointError(what + " addresses block " + std::to_string(max_block_index) + " (" + trained +
                          "), but this model has " + std::to_string(model_depth) +
                          " blocks: an adapter for a deeper model cannot be applied");
  }
  if (measured) m.positions = block_positions(m.source_depth, model_depth);
  return m;
}

}  // namespace sluice::anima
