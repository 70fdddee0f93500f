// The depth-expanded Anima block tables (Note [Anima block layout] in models/anima/block_layout.h),
// checked against the new-block lists of the issue and the model cards rather than against the
// tables themselves: the blocks a table leaves out must be exactly the new ones.
#include <catch2/catch.hpp>
#include <set>
#include <string>
#include <vector>

#include "models/anima/block_layout.h"
#include "runtime/error.h"

using namespace sluice::anima;

namespace {

// The blocks of a `depth`-block model that `positions` leaves out.
std::vector<int64_t> uncovered(const std::vector<int64_t>& positions, int64_t depth) {
  std::set<int64_t> covered(positions.begin(), positions.end());
  std::vector<int64_t> out;
  for (int64_t b = 0; b < depth; ++b)
    if (!covered.count(b)) out.push_back(b);
  return out;
}

bool strictly_increasing(const std::vector<int64_t>& v) {
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] <= v[i - 1]) return false;
  return true;
}

}  // namespace

TEST_CASE("block layout: the 2.9B table keeps the 28 base blocks in order and adds 12 at 2, 5, ..., 36") {
  const auto p = block_positions(28, 40);
  REQUIRE(p.size() == 28);
  CHECK(strictly_increasing(p));
  CHECK(p.front() == 0);
  CHECK(p.back() == 39);
  CHECK(uncovered(p, 40) == std::vector<int64_t>{2, 5, 8, 11, 14, 17, 21, 24, 27, 30, 33, 36});
}

TEST_CASE("block layout: the 3.8B table keeps the 40 2.9B blocks in order and adds 12 at 3, 7, ..., 47") {
  const auto p = block_positions(40, 52);
  REQUIRE(p.size() == 40);
  CHECK(strictly_increasing(p));
  CHECK(p.back() == 51);
  std::vector<int64_t> expected;
  for (int64_t b = 3; b <= 47; b += 4) expected.push_back(b);
  REQUIRE(expected.size() == 12);
  CHECK(uncovered(p, 52) == expected);
}

TEST_CASE("block layout: base -> 3.8B is base -> 2.9B followed by 2.9B -> 3.8B") {
  const auto a = block_positions(28, 40), b = block_positions(40, 52), c = block_positions(28, 52);
  REQUIRE(c.size() == 28);
  CHECK(strictly_increasing(c));
  for (size_t i = 0; i < c.size(); ++i) CHECK(c[i] == b[static_cast<size_t>(a[i])]);
  // 24 new blocks in all.
  CHECK(uncovered(c, 52).size() == 24);
}

TEST_CASE("block layout: other pairs have no table (indices as they are)") {
  CHECK(block_positions(28, 28).empty());
  CHECK(block_positions(40, 40).empty());
  CHECK(block_positions(52, 52).empty());
  CHECK(block_positions(40, 28).empty());
  CHECK(block_positions(28, 44).empty());
  CHECK(block_positions(2, 40).empty());
}

TEST_CASE("block layout: an adapter's depth is the smallest released depth above its highest block") {
  CHECK(adapter_source_depth(0) == 28);
  CHECK(adapter_source_depth(1) == 28);
  CHECK(adapter_source_depth(27) == 28);
  CHECK(adapter_source_depth(28) == 40);
  CHECK(adapter_source_depth(39) == 40);
  CHECK(adapter_source_depth(40) == 52);
  CHECK(adapter_source_depth(51) == 52);
  CHECK(adapter_source_depth(52) == -1);
  CHECK(adapter_source_depth(1000) == -1);
}

TEST_CASE("block layout: map_adapter_blocks remaps shallower adapters and leaves the rest as they are") {
  SECTION("base adapter on 2.9B: measured") {
    const auto m = map_adapter_blocks(27, 40, true, "LoRA 'x.safetensors'");
    CHECK(m.remapped());
    CHECK(m.source_depth == 28);
    CHECK(m.model_depth == 40);
    CHECK(m(0) == 0);
    CHECK(m(1) == 1);
    CHECK(m(2) == 3);
    CHECK(m(27) == 39);
    CHECK(m.describe("LoRA 'x.safetensors'") ==
          "LoRA 'x.safetensors' was trained on a 28-block Anima: its blocks go to their measured positions in "
          "this 40-block model (block 2 -> 3, ..., 27 -> 39); block_layout \"as-is\" (--adapter-blocks as-is) "
          "turns this off");
  }
  SECTION("an adapter touching only low blocks is still read as a base adapter") {
    const auto m = map_adapter_blocks(5, 52, true, "LoRA 'x'");
    CHECK(m.source_depth == 28);
    CHECK(m(5) == block_positions(28, 52)[5]);
  }
  SECTION("2.9B adapter on 3.8B") {
    const auto m = map_adapter_blocks(39, 52, true, "LLLite 'y'");
    CHECK(m.remapped());
    CHECK(m(3) == 4);
    CHECK(m(39) == 51);
    CHECK(m.describe("LLLite 'y'").find("(block 3 -> 4, ..., 39 -> 51)") != std::string::npos);
  }
  SECTION("as-is") {
    const auto m = map_adapter_blocks(27, 40, false, "LoRA 'x'");
    CHECK_FALSE(m.remapped());
    for (int64_t b : {0, 2, 27}) CHECK(m(b) == b);
  }
  SECTION("same depth, and a model of an unreleased depth") {
    CHECK_FALSE(map_adapter_blocks(27, 28, true, "LoRA 'x'").remapped());
    CHECK_FALSE(map_adapter_blocks(39, 40, true, "LoRA 'x'").remapped());
    CHECK_FALSE(map_adapter_blocks(1, 2, true, "LoRA 'x'").remapped());
    CHECK_FALSE(map_adapter_blocks(27, 30, true, "LoRA 'x'").remapped());
  }
  SECTION("no block targets") { CHECK_FALSE(map_adapter_blocks(-1, 40, true, "LoRA 'x'").remapped()); }
}

TEST_CASE("block layout: an adapter for a deeper model is refused, naming it, its block and the depth") {
  for (bool measured : {true, false}) {
    try {
      map_adapter_blocks(39, 28, measured, "LoRA 'deep.safetensors'");
      FAIL("no error");
    } catch (const sluice::CheckpointError& e) {
      CHECK(std::string(e.what()) ==
            "LoRA 'deep.safetensors' addresses block 39 (trained on a 40-block Anima), but this model has 28 "
            "blocks: an adapter for a deeper model cannot be applied");
    }
  }
  CHECK_THROWS_AS(map_adapter_blocks(2, 2, true, "LoRA 'x'"), sluice::CheckpointError);
  CHECK_THROWS_WITH(map_adapter_blocks(60, 52, true, "LLLite 'z'"),
                    Catch::Contains("LLLite 'z' addresses block 60 (deeper than any released Anima)"));
}
