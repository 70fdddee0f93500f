#pragma once
// Which layers stay in the compute dtype when a model is stored in fp8.
//
// Note [skip pattern matching]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Patterns are matched against a layer's dotted module name ("blocks.3.mlp.layer1").
//  - A *plain* pattern (letters, digits, '_', '-', and '.' as the component separator; no
//    other regex syntax) matches when it equals one whole dotted component of the name, or
//    a whole run of consecutive components: `t_embedder` matches `t_embedder.1.linear_1`;
//    `final_layer.linear` matches `final_layer.linear` and `x.final_layer.linear.y`.
//  - A pattern with any of ^ $ * + ? ( ) [ ] { } | \ is an ECMAScript std::regex, searched
//    (unanchored, like the reference system's re.search) in the full dotted name; '.' in it
//    is the regex wildcard.
// Why: the reference system searches every pattern as a regex, so its `t_embedder` also
// matches a `text_embedder` and keeps a layer in bf16 that the model never asked for.
// Whole-component matching asks for exactly the module the model names.
//
// Consequences, pinned by tests/runtime/test_skip_patterns.cpp:
//  - `t_embedder` does not match `text_embedder.linear` or `t_embedder_2.proj`.
//  - A user's plain `norm` matches only a component named `norm` (`llm_adapter.norm`), not
//    `t_embedding_norm` or `norm1.linear`. Write a regex (`norm`-containing, e.g.
//    `\w*norm\w*`) to get the reference's behaviour.
//  - The reference's default `norm` is an unanchored search meant to keep every
//    norm-owned Linear (AdaLayerNorm's `norm1.linear`, `norm_out.linear` in Flux/SD3-style
//    DiTs) in the compute dtype. Norm modules themselves are never cast (they are not
//    Linear/Embedding), so only those Linears are at stake. To keep that intent, the
//    default list spells it as the regex `\w*norm\w*`, which matches exactly the names the
//    reference's `norm` matches. On anima-2b no Linear or Embedding name contains "norm",
//    so the default list matches nothing there.
//  - `^proj_in$` / `^proj_out$` stay anchored regexes: only top-level `proj_in`/`proj_out`.
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/dtype_policy.h"

namespace sluice {

// The default patterns: pos_embed, patch_embed, \w*norm\w*, ^proj_in$, ^proj_out$.
// See Note [skip pattern matching] for why `norm` is spelled as a regex.
const std::vector<std::string>& default_skip_patterns();

// True when `pattern` is matched as a regex rather than as dotted components.
bool is_regex_pattern(std::string_view pattern);

// An ordered, de-duplicated list of skip patterns. Empty = nothing skipped.
class SkipList {
 public:
  SkipList() = default;
  // Throws InvalidArgument naming an empty or malformed pattern.
  explicit SkipList(const std::vector<std::string>& patterns);

  // The list a model load uses: defaults (if options.use_default_skips), then the model's
  // declared patterns (if options.use_model_skips), then options.extra_skip_patterns.
  static SkipList from_options(const Fp8Options& options, const std::vector<std::string>& model_patterns);

  // The first pattern (in list order) that matches `module_name`, for reporting; nullopt
  // when the layer is to be cast.
  std::optional<std::string> matches(std::string_view module_name) const;

  std::vector<std::string> patterns() const;
  bool empty() const { return entries_.empty(); }

 private:
  struct Entry {
    std::string pattern;
    std::vector<std::string> components;  // plain pattern split at '.'
    std::optional<std::regex> regex;      // set for regex patterns
  };
  void add(const std::string& pattern);
  std::vector<Entry> entries_;
};

}  // namespace sluice
