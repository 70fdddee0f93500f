#pragma once
// Where the depth-expanded Anima models keep the blocks of the model they grew from, and how an
// adapter's block indices (a LoRA's, an LLLite's) land on a model's blocks.
// Tested by: tests/models/anima/test_block_layout.cpp (the tables), tests/models/test_lora.cpp
// (a LoRA remapped onto 40- and 52-block models).
//
// Note [Anima block layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Anima-2.9B-preview-v1 (40 blocks) and Anima-3.8B v1.1 (52 blocks) insert new DiT blocks
// between the old ones, so an adapter trained on the shallower model and applied by index
// patches other blocks than it was trained on from the third block on. The positions below
// were measured from the released weights (InvokeAI's invokeai/backend/anima/block_layout.py):
//   - 2.9B holds the 28 base blocks bit for bit; its 12 new blocks are 2, 5, 8, 11, 14, 17,
//     21, 24, 27, 30, 33, 36.
//   - 3.8B holds the 2.9B's 40 blocks; its 12 new blocks are 3, 7, 11, ..., 47.
//   - base -> 3.8B is the composition of the two.
// An adapter's own depth is the smallest released depth (28, 40, 52) above its highest block
// index. Only the three pairs (28->40, 40->52, 28->52) move blocks; any other pair (the same
// depth, or a model of a depth that was never released, like the tiny test presets) keeps the
// indices as they are. An adapter that addresses a block the model lacks is refused.
#include <cstdint>
#include <string>
#include <vector>

namespace sluice::anima {

// The released Anima depths: base 28, 2.9B-preview-v1 40, 3.8B v1.1 52.
// The depth of the model an adapter was trained on, read off its highest block index: the smallest
// known depth above it; -1 above every known depth.
int64_t adapter_source_depth(int64_t max_block_index);

// The measured positions of a `source_depth`-block model's blocks in a `model_depth`-block model,
// or empty when the pair has no layout (indices as they are). Note [Anima block layout].
std::vector<int64_t> block_positions(int64_t source_depth, int64_t model_depth);

// How an adapter's block indices land on a model's blocks.
struct AdapterBlockMap {
  int64_t source_depth = -1;        // adapter_source_depth(max index), -1 unknown
  int64_t model_depth = 0;
  std::vector<int64_t> positions;   // positions[i] = the model block for adapter block i; empty = as is
  int64_t operator()(int64_t block) const;  // the model block for adapter block `block`
  bool remapped() const { return !positions.empty(); }
  // One log line for a remap, e.g. "LoRA 'x.safetensors' was trained on a 28-block Anima: its blocks go
  // to their measured positions in this 40-block model (block 2 -> 3, ..., 27 -> 39); block_layout
  // \"as-is\" (--adapter-blocks as-is) turns this off"
  std::string describe(const std::string& what) const;
};

// `what` names the adapter in messages ("LoRA 'x.safetensors'", "LLLite 'y.safetensors'").
// measured=false: indices as they are. Throws CheckpointError naming `what`, its highest block and
// the model's depth when the adapter addresses a block the model lacks (a deeper adapter).
AdapterBlockMap map_adapter_blocks(int64_t max_block_index, int64_t model_depth, bool measured,
                                   const std::string& what);

}  // namespace sluice::anima
