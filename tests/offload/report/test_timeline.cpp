// The SVG timeline (offload/report/timeline_svg.h, Note [timeline svg]): the renderer on a
// hand-built step (known spans give known boxes; names are escaped), the choice of the
// forward from a trace (Note [timeline forward]), and `sluice run --timeline` end to end:
// the SVG is well formed, has the three lanes, one compute box per layer the forward ran,
// resident and streamed boxes, a copy for every streamed layer, boxes inside the axis and
// the forward's bytes in its caption. Its pixels in a real browser are checked by
// tests/python/test_timeline_browser.py.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "offload/report/timeline_step.h"
#include "offload/report/timeline_svg.h"
#include "offload/report/trace.h"
#include "runtime/error.h"
#include "tests/support/cli_runner.h"
#include <sluice/sluice.hpp>

using namespace sluice::testing;
using sluice::offload::TimelineLane;
using sluice::offload::TimelineSpan;
using sluice::offload::TimelineStep;

namespace {

// A well-formedness check for the XML the renderer writes (no CDATA, comments or DTD):
// every tag closes in order, attributes are quoted in pairs, and every '&' starts an
// entity. Returns "" when it is well formed, else what is wrong.
std::string xml_problem(const std::string& s) {
  std::vector<std::string> open;
  size_t i = 0;
  size_t text_from = 0;
  auto check_text = [&](size_t a, size_t b) -> std::string {
    static const std::regex entity("^&(amp|lt|gt|quot|apos|#[0-9]+);");
    for (size_t k = a; k < b; ++k) {
      if (s[k] == '>') return "a raw '>' in text at " + std::to_string(k);
      if (s[k] == '&' && !std::regex_search(s.substr(k, 8), entity)) return "a bare '&' at " + std::to_string(k);
    }
    return "";
  };
  while ((i = s.find('<', i)) != std::string::npos) {
    if (!open.empty()) {
      const std::string p = check_text(text_from, i);
      if (!p.empty()) return p;
    }
    const size_t j = s.find('>', i);
    if (j == std::string::npos) return "a tag opened at " + std::to_string(i) + " never closes";
    const std::string tag = s.substr(i + 1, j - i - 1);
    if (tag.find('<') != std::string::npos) return "'<' inside the tag at " + std::to_string(i);
    if (std::count(tag.begin(), tag.end(), '"') % 2 != 0) return "unbalanced quotes in <" + tag + ">";
    if (tag.find('&') != std::string::npos) {
      // Inside attribute values: entities only.
      for (size_t k = 0; k < tag.size(); ++k) {
        static const std::regex entity("^&(amp|lt|gt|quot|apos|#[0-9]+);");
        if (tag[k] == '&' && !std::regex_search(tag.substr(k, 8), entity)) return "a bare '&' in <" + tag + ">";
      }
    }
    if (tag.empty()) return "an empty tag";
    if (tag[0] == '?') {
      if (tag.back() != '?') return "a bad processing instruction";
    } else if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name)
        return "</" + name + "> closes <" + (open.empty() ? std::string("nothing") : open.back()) + ">";
      open.pop_back();
    } else if (tag[0] == '!') {
      return "a comment or declaration (not written by the renderer)";
    } else {
      const std::string name = tag.substr(0, tag.find_first_of(" \t\n/"));
      if (tag.back() != '/') open.push_back(name);
    }
    i = j + 1;
    text_from = i;
  }
  if (!open.empty()) return "<" + open.back() + "> never closes";
  return "";
}

struct Rect {
  std::string cls, layer;
  double x = 0, w = 0;
};

// The <g id="..."> element's text, up to its </g> (lanes do not nest groups).
std::string group(const std::string& svg, const std::string& id) {
  const size_t a = svg.find("<g id=\"" + id + "\"");
  if (a == std::string::npos) return "";
  const size_t b = svg.find("</g>", a);
  return svg.substr(a, b == std::string::npos ? std::string::npos : b - a);
}

std::string attr(const std::string& tag, const std::string& name) {
  const std::regex re("\\s" + name + "=\"([^\"]*)\"");
  std::smatch m;
  return std::regex_search(tag, m, re) ? m[1].str() : std::string();
}

std::vector<Rect> span_rects(const std::string& g) {
  std::vector<Rect> out;
  const std::regex re("<rect class=\"span[^\"]*\"[^>]*>");
  for (auto it = std::sregex_iterator(g.begin(), g.end(), re); it != std::sregex_iterator(); ++it) {
    const std::string tag = it->str();
    Rect r;
    r.cls = attr(tag, "class");
    r.layer = attr(tag, "data-layer");
    r.x = std::stod(attr(tag, "x"));
    r.w = std::stod(attr(tag, "width"));
    out.push_back(r);
  }
  return out;
}

bool has_class(const Rect& r, const std::string& c) {
  const std::string padded = " " + r.cls + " ";
  return padded.find(" " + c + " ") != std::string::npos;
}

// A step from 1 ms to 11 ms on the trace clock; its first copy starts at 0.5 ms, so the
// window is 0.5..11 ms over the 1456 px plot (x from 120): 1456 / 10500 px per us.
TimelineStep hand_built() {
  TimelineStep s;
  s.model = "toy <model>";
  s.kind = "dit";
  s.forward = 4;
  s.begin_us = 1000;
  s.end_us = 11000;
  s.wall_ms = 10;
  s.bytes_streamed = 3 * 1024 * 1024;
  s.stall_ms = 0.5;
  s.stalls = 1;
  s.upcast_ms = 0.25;
  s.floor_ms = 8.0;
  s.predicted_step_ms = 9.5;
  auto add = [&](TimelineLane lane, std::string layer, double b, double d, bool resident) -> TimelineSpan& {
    TimelineSpan sp;
    sp.lane = lane;
    sp.layer = std::move(layer);
    sp.begin_us = b;
    sp.dur_us = d;
    sp.resident = resident;
    s.spans.push_back(sp);
    return s.spans.back();
  };
  add(TimelineLane::copy, "blocks.0.q", 500, 1000, false);
  add(TimelineLane::compute, "blocks.0.q", 1500, 500, false).stall = true;
  add(TimelineLane::compute, "blocks.0.q", 2000, 3000, false);
  add(TimelineLane::upcast, "a<&\"b", 5500, 500, true);
  add(TimelineLane::compute, "a<&\"b", 6000, 2000, true);
  add(TimelineLane::compute, "blocks.12.self_attn.output_projection", 8000, 300, true);  // 41.6 px: elided
  add(TimelineLane::copy, "blocks.0.q", 9000, 1000, false).next = true;
  add(TimelineLane::compute, "blocks.9.mlp", 0, 1000, false).other = true;  // clipped to 0.5..1 ms
  return s;
}

}  // namespace

TEST_CASE("timeline: the renderer puts known spans at known positions and escapes names", "[strict]") {
  const std::string svg = sluice::offload::render_timeline_svg(hand_built());
  INFO(svg.substr(0, 4000));
  CHECK(xml_problem(svg).empty());
  INFO(xml_problem(svg));
  CHECK(svg.find("<script") == std::string::npos);
  CHECK(svg.find("href") == std::string::npos);  // no links, images or external fonts
  CHECK(svg.find("@import") == std::string::npos);
  CHECK(svg.find("<g id=\"lane-copy\" class=\"lane\"") != std::string::npos);
  CHECK(svg.find("<g id=\"lane-upcast\" class=\"lane\"") != std::string::npos);
  CHECK(svg.find("<g id=\"lane-compute\" class=\"lane\"") != std::string::npos);

  const std::vector<Rect> copy = span_rects(group(svg, "lane-copy"));
  const std::vector<Rect> upcast = span_rects(group(svg, "lane-upcast"));
  const std::vector<Rect> compute = span_rects(group(svg, "lane-compute"));
  REQUIRE(copy.size() == 2);
  REQUIRE(upcast.size() == 1);
  REQUIRE(compute.size() == 5);
  const double k = 1456.0 / 10500.0;
  // The copy for this forward starts the window; the next forward's is lighter ("next").
  CHECK(copy[0].cls == "span streamed");
  CHECK(copy[0].x == Approx(120.0).margin(0.01));
  CHECK(copy[0].w == Approx(1000 * k).margin(0.01));
  CHECK(copy[1].cls == "span streamed next");
  CHECK(copy[1].x == Approx(120 + 8500 * k).margin(0.01));
  // Other forwards' work first (grey, clipped to the window), then this forward's.
  CHECK(compute[0].cls == "span other");
  CHECK(compute[0].x == Approx(120.0).margin(0.01));
  CHECK(compute[0].w == Approx(500 * k).margin(0.01));
  CHECK(compute[1].cls == "span stall");
  CHECK(compute[1].x == Approx(120 + 1000 * k).margin(0.01));
  CHECK(compute[2].cls == "span streamed");
  CHECK(compute[2].x == Approx(120 + 1500 * k).margin(0.01));
  CHECK(compute[2].w == Approx(3000 * k).margin(0.01));
  CHECK(compute[3].cls == "span resident");
  CHECK(compute[3].layer == "a&lt;&amp;&quot;b");
  CHECK(upcast[0].cls == "span resident");
  CHECK(svg.find("<svg ") != std::string::npos);
  CHECK(svg.find("data-forward=\"4\"") != std::string::npos);

  // Names are escaped everywhere; the raw name never appears.
  CHECK(svg.find("a<&\"b") == std::string::npos);
  CHECK(svg.find("<title>a&lt;&amp;&quot;b (resident)") != std::string::npos);
  CHECK(svg.find("toy &lt;model&gt;") != std::string::npos);
  // A narrow box shows a short form of its name; the title has the full one.
  CHECK(svg.find(">blocks.12.self_attn.output_projection</text>") == std::string::npos);
  CHECK(svg.find("<title>blocks.12.self_attn.output_projection (resident)") != std::string::npos);
  CHECK(svg.find(">outpu\xE2\x80\xA6</text>") != std::string::npos);  // 41.6 px: 6 glyphs
  CHECK(svg.find(">blocks.0.q</text>") != std::string::npos);         // a wide box: the full name

  // Groups of consecutive compute boxes, named by their block.
  const std::string groups = group(svg, "groups");
  const std::regex group_re("data-group=\"([^\"]*)\"");
  std::vector<std::string> names;
  for (auto it = std::sregex_iterator(groups.begin(), groups.end(), group_re); it != std::sregex_iterator(); ++it)
    names.push_back((*it)[1].str());
  CHECK(names == std::vector<std::string>{"blocks.0", "a&lt;&amp;&quot;b", "blocks.12"});
  CHECK(groups.find(">blocks.0</text>") != std::string::npos);

  // The caption: exact numbers in attributes, readable ones in the text.
  const std::string cap = svg.substr(svg.find("<text id=\"caption\""), 1000);
  CHECK(attr(cap, "data-bytes-streamed") == "3145728");
  CHECK(attr(cap, "data-stalls") == "1");
  CHECK(attr(cap, "data-floor-ms") == "8.000");
  CHECK(attr(cap, "data-predicted-step-ms") == "9.500");
  CHECK(cap.find("step 10.00 ms") != std::string::npos);
  CHECK(cap.find("streamed 3.00 MiB") != std::string::npos);
  CHECK(cap.find("stalls 1 (0.50 ms") != std::string::npos);
  CHECK(cap.find("upcast 0.25 ms") != std::string::npos);
  CHECK(cap.find("floor 8.00 ms, predicted 9.50 ms") != std::string::npos);

  // The axis: ticks in ms since the forward began, over the whole window.
  const std::string axis = group(svg, "axis");
  CHECK(attr(axis, "data-x0") == "120.00");
  CHECK(attr(axis, "data-x1") == "1576.00");
  CHECK(attr(axis, "data-t0-ms") == "-0.500");
  CHECK(attr(axis, "data-t1-ms") == "10.000");
  CHECK(axis.find(">0</text>") != std::string::npos);
  CHECK(axis.find(">10</text>") != std::string::npos);
  CHECK(svg.find("<g id=\"legend\">") != std::string::npos);

  // No plan prediction: the caption says so.
  TimelineStep s = hand_built();
  s.floor_ms.reset();
  s.predicted_step_ms.reset();
  const std::string bare = sluice::offload::render_timeline_svg(s);
  CHECK(bare.find("data-floor-ms") == std::string::npos);
  CHECK(bare.find("plan: no prediction") != std::string::npos);
  // A forward that does not end after it begins is refused.
  s.end_us = s.begin_us;
  CHECK_THROWS_AS(sluice::offload::render_timeline_svg(s), sluice::InvalidArgument);
  // An unwritable path names it.
  try {
    sluice::offload::write_timeline_svg_file(svg, "/nonexistent-dir/t.svg");
    FAIL("no error");
  } catch (const sluice::FileError& e) {
    CHECK(std::string(e.what()).find("/nonexistent-dir/t.svg") != std::string::npos);
  }
}

TEST_CASE("timeline: the forward drawn is the last complete dit one, or an earlier one that shows its prefetches",
          "[strict]") {
  using sluice::offload::TraceTrack;
  using sluice::offload::TraceWriter;
  // Forwards 0..3 of 1 ms each, 2 ms apart; layers "a" (resident) and "b" (streamed,
  // copied during the previous forward). Forward 3 is the last.
  auto trace = [](bool same_residency, bool last_complete) {
    TraceWriter w;
    for (int64_t f = 0; f < 4; ++f) {
      const double t = 2000.0 * static_cast<double>(f);
      const bool b_resident = !same_residency && f == 3;
      w.add_span(TraceTrack::forward, "forward", t, 1000,
                 {{"forward", f},
                  {"kind", std::string("dit")},
                  {"complete", f < 3 || last_complete},
                  {"wall_ms", 1.0},
                  {"bytes_streamed", int64_t{100 + f}},
                  {"stall_ms", 0.0},
                  {"upcast_ms", 0.0},
                  {"stalls", int64_t{0}}});
      w.add_span(TraceTrack::compute, "a", t, 400, {{"forward", f}, {"layer", std::string("a")}, {"resident", true}});
      w.add_span(TraceTrack::compute, "b", t + 500, 400,
                 {{"forward", f}, {"layer", std::string("b")}, {"resident", b_resident}});
      w.add_span(TraceTrack::copy, "b", t - 1500, 300,
                 {{"forward", f}, {"layer", std::string("b")}, {"resident", false}});
    }
    return w.to_json();
  };
  // Same residency throughout: forward 2, the last one followed by another.
  TimelineStep s = sluice::offload::timeline_step_from_trace(trace(true, true));
  CHECK(s.forward == 2);
  CHECK(s.bytes_streamed == 102);
  int next = 0, own = 0, other = 0;
  for (const auto& sp : s.spans) {
    next += sp.next ? 1 : 0;
    other += sp.other ? 1 : 0;
    own += (!sp.next && !sp.other) ? 1 : 0;
  }
  CHECK(own == 3);
  CHECK(next == 1);   // forward 3's copy, issued during forward 2
  CHECK(other >= 1);  // forward 1's compute beside forward 2's early copy
  CHECK(s.begin_us == Approx(4000));
  CHECK(s.end_us == Approx(5000));
  // Forward 3 ran under another residency: it is the steady state, drawn without prefetches.
  s = sluice::offload::timeline_step_from_trace(trace(false, true));
  CHECK(s.forward == 3);
  // Forward 3 aborted: forward 2 is the last complete one.
  s = sluice::offload::timeline_step_from_trace(trace(false, false));
  CHECK(s.forward == 2);
  // No forward of the kind, no forwards at all, not a trace: one clear error each.
  CHECK_THROWS_WITH(sluice::offload::timeline_step_from_trace(trace(true, true), "adapter"),
                    Catch::Contains("no complete 'adapter' forward"));
  CHECK_THROWS_WITH(sluice::offload::timeline_step_from_trace(TraceWriter().to_json()),
                    Catch::Contains("0 forwards traced"));
  CHECK_THROWS_AS(sluice::offload::timeline_step_from_trace("{\"traceEvents\": 3}"), sluice::InvalidArgument);
  CHECK_THROWS_AS(sluice::offload::timeline_step_from_trace("not json"), sluice::InvalidArgument);
}

TEST_CASE("timeline: sluice run --timeline draws one forward's layers on three lanes", "[strict]") {
  TempDir dir;
  const std::string svg_path = dir / "t.svg", trace_path = dir / "t.json", stats_path = dir / "s.json";
  const Result r =
      run_ok({"run", "--synthetic", "anima-tiny", "--device", "cpu", "--max-resident", "0.5", "--steps", "3",
              "--resolution", "64", "--timeline", svg_path, "--trace", trace_path, "--stats-json", stats_path});
  CHECK(r.out.find("wrote " + svg_path + "\n") != std::string::npos);
  const std::string svg = slurp(svg_path);
  INFO(svg.substr(0, 3000));
  REQUIRE(xml_problem(svg).empty());
  REQUIRE(svg.find("<g id=\"lane-copy\" class=\"lane\"") != std::string::npos);
  REQUIRE(svg.find("<g id=\"lane-upcast\" class=\"lane\"") != std::string::npos);
  REQUIRE(svg.find("<g id=\"lane-compute\" class=\"lane\"") != std::string::npos);
  std::smatch m;
  REQUIRE(std::regex_search(svg, m, std::regex("<svg [^>]*data-forward=\"([0-9]+)\"")));
  const int64_t forward = std::stoll(m[1].str());

  // What the forward ran, from the trace written beside it.
  const nlohmann::json trace = nlohmann::json::parse(slurp(trace_path));
  int64_t layers_run = 0, waits = 0, forwards = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    REQUIRE(e.contains("args"));
    const auto& args = e.at("args");
    if (e.at("tid") == 4) {
      ++forwards;
      CHECK(args.at("kind") == "dit");
      continue;
    }
    if (args.at("forward").get<int64_t>() != forward || e.at("tid") != 3) continue;
    const bool wait = e.at("name").get<std::string>().rfind("wait ", 0) == 0;
    (wait ? waits : layers_run) += 1;
  }
  CHECK(forwards == 3);  // one per step (CFG: batch 2)
  CHECK(forward >= 1);

  const std::vector<Rect> copy = span_rects(group(svg, "lane-copy"));
  const std::vector<Rect> upcast = span_rects(group(svg, "lane-upcast"));
  const std::vector<Rect> compute = span_rects(group(svg, "lane-compute"));
  std::set<std::string> copied;
  for (const auto& c : copy) {
    CHECK(has_class(c, "streamed"));
    if (!has_class(c, "next")) copied.insert(c.layer);
  }
  int64_t boxes = 0, resident = 0, streamed = 0, stalls = 0;
  std::set<std::string> streamed_layers;
  for (const auto& c : compute) {
    if (has_class(c, "other")) continue;
    if (has_class(c, "stall")) {
      ++stalls;
      continue;
    }
    ++boxes;
    if (has_class(c, "resident")) ++resident;
    if (has_class(c, "streamed")) {
      ++streamed;
      streamed_layers.insert(c.layer);
    }
  }
  CHECK(boxes == layers_run);
  CHECK(layers_run > 0);
  CHECK(stalls == waits);
  CHECK(resident > 0);  // --max-resident 0.5: both kinds
  CHECK(streamed > 0);
  CHECK(!upcast.empty());  // fp8 storage
  for (const auto& layer : streamed_layers) {
    INFO("streamed layer " << layer);
    CHECK(copied.count(layer) == 1);  // every streamed layer was copied for this forward
  }

  // Every box lies inside the axis.
  const std::string axis = group(svg, "axis");
  const double x0 = std::stod(attr(axis, "data-x0")), x1 = std::stod(attr(axis, "data-x1"));
  for (const auto* lane : {&copy, &upcast, &compute}) {
    for (const auto& b : *lane) {
      INFO(b.cls << " " << b.layer << " x " << b.x << " width " << b.w);
      CHECK(b.x >= x0 - 1e-6);
      CHECK(b.w > 0);
      CHECK(b.x + b.w <= x1 + 0.011);  // rounding to 2 decimals
    }
  }

  // The caption's totals are the forward's in the stats JSON.
  const nlohmann::json stats = nlohmann::json::parse(slurp(stats_path));
  const nlohmann::json* rec = nullptr;
  for (const auto& f : stats.at("forwards"))
    if (f.at("index").get<int64_t>() == forward) rec = &f;
  REQUIRE(rec != nullptr);
  const std::string cap = svg.substr(svg.find("<text id=\"caption\""), 1000);
  CHECK(std::stoull(attr(cap, "data-bytes-streamed")) == rec->at("bytes_streamed").get<uint64_t>());
  CHECK(rec->at("bytes_streamed").get<uint64_t>() > 0);
  CHECK(std::stod(attr(cap, "data-wall-ms")) == Approx(rec->at("wall_ms").get<double>()).margin(0.001));
  CHECK(std::stod(attr(cap, "data-stall-ms")) == Approx(rec->at("stall_ms").get<double>()).margin(0.001));
  CHECK(std::stod(attr(cap, "data-upcast-ms")) == Approx(rec->at("upcast_ms").get<double>()).margin(0.001));
  CHECK(cap.find("anima-tiny") == std::string::npos);  // the model is in the title
  CHECK(svg.find("<text id=\"title\"") != std::string::npos);
  CHECK(svg.find(">anima-tiny: forward " + std::to_string(forward)) != std::string::npos);
  const nlohmann::json& plan = stats.at("plan");
  if (plan.at("floor_ms").is_number()) {
    CHECK(std::stod(attr(cap, "data-floor-ms")) == Approx(plan.at("floor_ms").get<double>()).margin(0.001));
  }
}

TEST_CASE("timeline: bad paths and a model without a traced forward are one-line errors", "[strict]") {
  TempDir dir;
  const std::vector<std::string> base{"run",     "--synthetic", "anima-tiny",   "--device", "cpu",
                                      "--steps", "1",           "--resolution", "64"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  // Checked before the run starts: usage errors.
  expect_error(with({"--timeline", "/nonexistent-dir/t.svg"}), 2, {"--timeline", "/nonexistent-dir/t.svg"});
  expect_error(with({"--timeline", dir.path}), 2, {"--timeline", dir.path, "folder"});
  expect_error(with({"--timeline"}), 2, {"--timeline"});  // no file named
  expect_error(with({"--timeline", ""}), 2, {"--timeline"});

  // Through the API: a path that cannot be written is a FileError naming it.
  {
    sluice::RuntimeOptions ro;
    ro.device = "cpu";
    ro.trace = true;
    sluice::ModelCache cache(ro);
    sluice::LoadOptions lo;
    lo.max_resident = 0.5;
    sluice::Model model = cache.load("anima-tiny", lo);
    {
      sluice::LockedModel locked = model.lock();
      const sluice::ModelInfo& info = locked.info();
      at::Generator gen = at::detail::createCPUGenerator(5);
      const at::Tensor x = at::randn({2, info.in_channels, 1, 8, 8}, gen);
      const at::Tensor ctx = at::randn({2, 6, info.context_dim}, gen);
      for (int i = 0; i < 3; ++i) locked.forward(x, at::full({2}, 0.5, at::kFloat), ctx);
    }
    model.write_timeline_svg(dir / "api.svg");
    CHECK(xml_problem(slurp(dir / "api.svg")).empty());
    ::unlink((dir / "api.svg").c_str());
    try {
      model.write_timeline_svg("/nonexistent-dir/api.svg");
      FAIL("no error");
    } catch (const sluice::FileError& e) {
      CHECK(std::string(e.what()).find("'/nonexistent-dir/api.svg'") != std::string::npos);
    }
  }

  // Tracing off, and tracing on before any forward: InvalidArgument, one line.
  for (bool trace : {false, true}) {
    INFO("trace " << trace);
    sluice::RuntimeOptions ro;
    ro.device = "cpu";
    ro.trace = trace;
    sluice::ModelCache cache(ro);
    sluice::Model model = cache.load("anima-tiny", sluice::LoadOptions{});
    try {
      model.write_timeline_svg(dir / "api.svg");
      FAIL("no error");
    } catch (const sluice::InvalidArgument& e) {
      const std::string what = e.what();
      CHECK(what.find("anima-tiny") != std::string::npos);
      CHECK(what.find(trace ? "traced" : "tracing is off") != std::string::npos);
      CHECK(what.find('\n') == std::string::npos);
    }
    CHECK_FALSE(exists(dir / "api.svg"));
  }
}
