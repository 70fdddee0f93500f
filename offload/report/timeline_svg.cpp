#include "offload/report/timeline_svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <tuple>
#include <utility>

#include "runtime/error.h"
#include "runtime/text_file.h"

namespace sluice::offload {
namespace {

// Layout (user units = CSS px at 100%).
constexpr double kWidth = 1600;
constexpr double kLeft = 120;  // lane labels
constexpr double kRight = 24;
constexpr double kPlot = kWidth - kLeft - kRight;
constexpr double kTitleY = 26;
constexpr double kCaptionY = 48;
constexpr double kLaneTop = 80;
constexpr double kLaneH = 40;
constexpr double kLaneGap = 12;
constexpr double kLanesBottom = kLaneTop + 3 * kLaneH + 2 * kLaneGap;
constexpr double kGroupY = kLanesBottom + 6;  // the layer groups' brackets under the compute lane
constexpr double kAxisY = kGroupY + 26;
constexpr double kLegendY = kAxisY + 56;
constexpr double kHeight = kLegendY + 22;
constexpr double kMinBox = 0.75;   // narrowest box drawn, so a short span stays visible
constexpr double kLabelFont = 10;  // px, monospace
constexpr double kCharW = 6.2;     // a monospace glyph at kLabelFont, with a little slack
constexpr double kLabelPad = 4;

// Colours (the browser test looks for the resident and streamed fills: keep them in step
// with tests/python/test_timeline_browser.py).
constexpr const char* kResident = "#5b8fd0";
constexpr const char* kStreamed = "#f58518";
constexpr const char* kNext = "#fbd3a8";
constexpr const char* kOther = "#c9c9c9";
constexpr const char* kStall = "#d62728";
constexpr const char* kLaneBg = "#f2f2f2";

std::string num(double v, int prec = 2) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, std::isfinite(v) ? v : 0.0);
  return buf;
}

std::string xml_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // Control characters are not allowed in XML 1.0 (tab, newline, CR are).
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') {
          out += '?';
        } else {
          out += c;
        }
    }
  }
  return out;
}

// Characters (code points) in UTF-8 `s`.
size_t glyphs(const std::string& s) {
  size_t n = 0;
  for (char c : s)
    if ((static_cast<unsigned char>(c) & 0xC0) != 0x80) ++n;
  return n;
}

bool fits(const std::string& s, double width) { return glyphs(s) * kCharW + kLabelPad <= width; }

bool is_number(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Note [timeline labels]
// ~~~~~~~~~~~~~~~~~~~~~~
// A box shows the longest of these that fits its width, else nothing (the <title> always
// has the full name): the full name ("blocks.3.self_attn.q_proj"); without its leading
// container ("3.self_attn.q_proj"); the block number and the last part ("3.q_proj"); the
// last part ("q_proj"); the last part cut short with an ellipsis ("q_p…", at least two
// characters). Glyph widths are estimated for a monospace font, so labels never spill
// over their box into the next one's. At 1600 px a forward of a hundred layers leaves most
// boxes a few px wide, so a row of brackets under the compute lane names the groups
// ("blocks.3", or "3" when narrow) that consecutive boxes belong to.
std::string fit_label(const std::string& name, double width) {
  if (fits(name, width)) return name;
  std::vector<std::string> parts;
  std::stringstream in(name);
  for (std::string p; std::getline(in, p, '.');) parts.push_back(p);
  if (parts.size() > 1) {
    std::vector<std::string> candidates;
    if (is_number(parts[1])) {
      std::string rest = parts[1];
      for (size_t i = 2; i < parts.size(); ++i) rest += "." + parts[i];
      candidates.push_back(rest);
    }
    for (size_t k = 0; k + 2 < parts.size(); ++k) {
      if (is_number(parts[k])) {
        candidates.push_back(parts[k] + "." + parts.back());
        break;
      }
    }
    candidates.push_back(parts.back());
    for (const auto& c : candidates)
      if (fits(c, width)) return c;
  }
  const std::string& last = parts.empty() ? name : parts.back();
  for (size_t n = last.size(); n-- > 2;) {
    if ((static_cast<unsigned char>(last[n]) & 0xC0) == 0x80) continue;  // not inside a UTF-8 sequence
    const std::string cut = last.substr(0, n) + "\xE2\x80\xA6";          // U+2026
    if (fits(cut, width)) return cut;
  }
  return "";
}

// The group a layer belongs to: its name up to its first number ("blocks.3" of
// "blocks.3.mlp.layer1"), else its first part ("x_embedder" of "x_embedder.proj").
std::string group_of(const std::string& name) {
  size_t from = 0;
  while (from <= name.size()) {
    size_t dot = name.find('.', from);
    if (dot == std::string::npos) dot = name.size();
    if (is_number(name.substr(from, dot - from))) return name.substr(0, dot);
    from = dot + 1;
  }
  const size_t first = name.find('.');
  return first == std::string::npos ? name : name.substr(0, first);
}

// A tick step of 1, 2 or 5 times a power of ten giving at most `most` ticks over `range`.
double tick_step(double range, int most) {
  if (!(range > 0)) return 1;
  const double mag = std::pow(10.0, std::floor(std::log10(range / most)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (range / (m * mag) <= most) return m * mag;
  return 10 * mag;
}

const char* lane_id(TimelineLane lane) {
  switch (lane) {
    case TimelineLane::copy: return "lane-copy";
    case TimelineLane::upcast: return "lane-upcast";
    case TimelineLane::compute: return "lane-compute";
  }
  return "?";
}

const char* verb(TimelineLane lane, bool stall) {
  if (stall) return "waited for its copy";
  switch (lane) {
    case TimelineLane::copy: return "copied host->device";
    case TimelineLane::upcast: return "upcast";
    case TimelineLane::compute: return "computed";
  }
  return "";
}

}  // namespace

std::string render_timeline_svg(const TimelineStep& step) {
  if (!(step.end_us > step.begin_us))
    throw InvalidArgument("timeline of forward " + std::to_string(step.forward) + ": it ends at " + num(step.end_us) +
                          " us, not after its begin at " + num(step.begin_us) + " us");
  // The window: this forward and all of its own work (early copies start before it), and
  // the next forward's copies issued during it.
  double t0 = step.begin_us, t1 = step.end_us;
  for (const auto& s : step.spans) {
    if (s.other) continue;
    if (s.next && s.begin_us >= step.end_us) continue;
    t0 = std::min(t0, s.begin_us);
    t1 = std::max(t1, s.begin_us + s.dur_us);
  }
  const double scale = kPlot / (t1 - t0);  // px per us
  auto X = [&](double us) { return kLeft + (us - t0) * scale; };
  auto ms = [&](double us) { return (us - step.begin_us) / 1000.0; };  // since the forward began
  const double x_end = kLeft + kPlot;

  std::ostringstream o;
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(kWidth, 0) << "\" height=\"" << num(kHeight, 0)
    << "\" viewBox=\"0 0 " << num(kWidth, 0) << " " << num(kHeight, 0)
    << "\" font-family=\"DejaVu Sans, Arial, Helvetica, sans-serif\" data-forward=\"" << step.forward << "\">\n";
  o << "<defs>\n"
    << "<pattern id=\"stall-hatch\" patternUnits=\"userSpaceOnUse\" width=\"6\" height=\"6\" "
       "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#fde0e0\"/>"
       "<rect width=\"3\" height=\"6\" fill=\""
    << kStall << "\"/></pattern>\n"
    << "<style>.label{font-family:'DejaVu Sans Mono',Menlo,Consolas,monospace;font-size:" << num(kLabelFont, 0)
    << "px;fill:#111;pointer-events:none}.lane-label{font-size:13px;font-weight:bold;fill:#222}"
       ".lane-sub{font-size:10px;fill:#666}.tick-label{font-size:10px;fill:#333}"
       ".marker-label{font-size:10px;fill:#444}"
       ".group-label{font-family:'DejaVu Sans "
       "Mono',Menlo,Consolas,monospace;font-size:10px;fill:#444}.legend-text{font-size:11px;fill:#222}</style>\n"
    << "</defs>\n";
  o << "<rect id=\"background\" x=\"0\" y=\"0\" width=\"" << num(kWidth, 0) << "\" height=\"" << num(kHeight, 0)
    << "\" fill=\"#ffffff\"/>\n";

  // Title and caption.
  int64_t stall_boxes = 0;
  for (const auto& s : step.spans)
    if (s.stall && !s.other) ++stall_boxes;
  o << "<text id=\"title\" x=\"" << num(12, 0) << "\" y=\"" << num(kTitleY, 0)
    << "\" font-size=\"16\" font-weight=\"bold\" fill=\"#111\">"
    << xml_escape(step.model.empty() ? "model" : step.model) << ": forward " << step.forward
    << (step.kind.empty() ? "" : " (" + xml_escape(step.kind) + ")") << ", one steady-state step</text>\n";
  o << "<text id=\"caption\" x=\"" << num(12, 0) << "\" y=\"" << num(kCaptionY, 0)
    << "\" font-size=\"13\" fill=\"#222\" data-bytes-streamed=\"" << step.bytes_streamed << "\" data-wall-ms=\""
    << num(step.wall_ms, 3) << "\" data-stall-ms=\"" << num(step.stall_ms, 3) << "\" data-stalls=\"" << step.stalls
    << "\" data-upcast-ms=\"" << num(step.upcast_ms, 3) << "\"";
  if (step.floor_ms) o << " data-floor-ms=\"" << num(*step.floor_ms, 3) << "\"";
  if (step.predicted_step_ms) o << " data-predicted-step-ms=\"" << num(*step.predicted_step_ms, 3) << "\"";
  o << ">step " << num(step.wall_ms) << " ms \xC2\xB7 streamed "
    << num(static_cast<double>(step.bytes_streamed) / (1024.0 * 1024.0)) << " MiB \xC2\xB7 stalls " << step.stalls
    << " (" << num(step.stall_ms) << " ms waiting for copies) \xC2\xB7 upcast " << num(step.upcast_ms)
    << " ms \xC2\xB7 ";
  if (step.floor_ms || step.predicted_step_ms) {
    o << "plan:";
    if (step.floor_ms) o << " floor " << num(*step.floor_ms) << " ms";
    if (step.floor_ms && step.predicted_step_ms) o << ",";
    if (step.predicted_step_ms) o << " predicted " << num(*step.predicted_step_ms) << " ms";
  } else {
    o << "plan: no prediction (not made from measurements)";
  }
  o << "</text>\n";

  const double lanes_bottom = kLanesBottom;
  // Lanes.
  struct LaneInfo {
    TimelineLane lane;
    const char* name;
    const char* sub;
  };
  const LaneInfo lanes[] = {{TimelineLane::copy, "copy", "host \xE2\x86\x92 device"},
                            {TimelineLane::upcast, "upcast", "storage \xE2\x86\x92 compute"},
                            {TimelineLane::compute, "compute", "layer forward"}};
  for (size_t li = 0; li < 3; ++li) {
    const LaneInfo& L = lanes[li];
    const double y = kLaneTop + static_cast<double>(li) * (kLaneH + kLaneGap);
    o << "<g id=\"" << lane_id(L.lane) << "\" class=\"lane\" data-y=\"" << num(y) << "\" data-height=\"" << num(kLaneH)
      << "\">\n";
    o << "<rect class=\"lane-bg\" x=\"" << num(kLeft) << "\" y=\"" << num(y) << "\" width=\"" << num(kPlot)
      << "\" height=\"" << num(kLaneH) << "\" fill=\"" << kLaneBg << "\"/>\n";
    o << "<text class=\"lane-label\" x=\"" << num(kLeft - 10) << "\" y=\"" << num(y + 18) << "\" text-anchor=\"end\">"
      << L.name << "</text>\n";
    o << "<text class=\"lane-sub\" x=\"" << num(kLeft - 10) << "\" y=\"" << num(y + 31) << "\" text-anchor=\"end\">"
      << L.sub << "</text>\n";
    std::ostringstream labels;
    // Other forwards' work first, so this forward's boxes are drawn over it.
    for (int pass = 0; pass < 2; ++pass) {
      for (const auto& s : step.spans) {
        if (s.lane != L.lane || s.other != (pass == 0)) continue;
        double a = s.begin_us, b = s.begin_us + s.dur_us;
        if (s.other || s.next) {
          if (b < t0 || a > t1 || (s.next && a >= step.end_us)) continue;
          a = std::max(a, t0);
          b = std::min(b, t1);
        }
        const double w = std::max((b - a) * scale, kMinBox);
        const double x = std::clamp(X(a), kLeft, x_end - w);
        std::string cls, fill;
        if (s.other) {
          cls = "other";
          fill = kOther;
        } else if (s.stall) {
          cls = "stall";
          fill = "url(#stall-hatch)";
        } else {
          cls = s.resident ? "resident" : "streamed";
          fill = s.next ? kNext : (s.resident ? kResident : kStreamed);
          if (s.next) cls += " next";
        }
        const double inset = s.stall ? 2 : 0;
        o << "<rect class=\"span " << cls << "\" data-layer=\"" << xml_escape(s.layer) << "\" data-begin-ms=\""
          << num(ms(s.begin_us), 3) << "\" data-dur-ms=\"" << num(s.dur_us / 1000.0, 3) << "\" x=\"" << num(x)
          << "\" y=\"" << num(y + inset) << "\" width=\"" << num(w) << "\" height=\"" << num(kLaneH - 2 * inset)
          << "\" fill=\"" << fill << "\"";
        if (s.stall)
          o << " stroke=\"" << kStall << "\" stroke-width=\"1\"";
        else if (w >= 3)
          o << " stroke=\"#ffffff\" stroke-width=\"0.6\"";
        const std::string title = s.layer + " (" + (s.other ? "another forward" : cls) + "): " + verb(s.lane, s.stall) +
                                  " for " + num(s.dur_us / 1000.0, 3) + " ms at " + num(ms(s.begin_us), 3) + " ms";
        o << "><title>" << xml_escape(title) << "</title></rect>\n";
        if (!s.other && !s.stall) {
          const std::string text = fit_label(s.layer, w);
          if (!text.empty()) {
            labels << "<text class=\"label\" x=\"" << num(x + w / 2) << "\" y=\"" << num(y + kLaneH / 2 + 3.5)
                   << "\" text-anchor=\"middle\">" << xml_escape(text) << "</text>\n";
          }
        }
      }
    }
    o << labels.str() << "</g>\n";
  }

  // Layer groups (Note [timeline labels]): a bracket under the compute lane per run of
  // this forward's compute boxes in one group ("blocks.3"), so the picture reads by block
  // even where single boxes are too narrow for a label.
  {
    std::vector<const TimelineSpan*> boxes;
    for (const auto& s : step.spans)
      if (s.lane == TimelineLane::compute && !s.other && !s.stall) boxes.push_back(&s);
    std::stable_sort(boxes.begin(), boxes.end(),
                     [](const TimelineSpan* a, const TimelineSpan* b) { return a->begin_us < b->begin_us; });
    o << "<g id=\"groups\">\n";
    for (size_t i = 0; i < boxes.size();) {
      const std::string key = group_of(boxes[i]->layer);
      size_t j = i + 1;
      double end = boxes[i]->begin_us + boxes[i]->dur_us;
      while (j < boxes.size() && group_of(boxes[j]->layer) == key) {
        end = std::max(end, boxes[j]->begin_us + boxes[j]->dur_us);
        ++j;
      }
      const double xa = std::clamp(X(boxes[i]->begin_us), kLeft, x_end), xb = std::clamp(X(end), kLeft, x_end);
      o << "<path class=\"group\" data-group=\"" << xml_escape(key) << "\" d=\"M" << num(xa) << " " << num(kGroupY)
        << " v5 H" << num(std::max(xb, xa + 1)) << " v-5\" fill=\"none\" stroke=\"#777\" stroke-width=\"1\"/>\n";
      std::string text = key;
      if (!fits(text, xb - xa)) {
        const size_t dot = key.rfind('.');
        text = dot == std::string::npos ? "" : key.substr(dot + 1);
        if (!fits(text, xb - xa)) text.clear();
      }
      if (!text.empty()) {
        o << "<text class=\"group-label\" x=\"" << num((xa + xb) / 2) << "\" y=\"" << num(kGroupY + 16)
          << "\" text-anchor=\"middle\">" << xml_escape(text) << "</text>\n";
      }
      i = j;
    }
    o << "</g>\n";
  }

  // Outside this forward's begin..end: a grey veil over the lanes; its begin and end: dashed lines.
  o << "<g id=\"forward-window\" data-begin-ms=\"0.000\" data-end-ms=\"" << num(ms(step.end_us), 3) << "\">\n";
  for (const auto& [a, b] : {std::pair<double, double>{t0, step.begin_us}, {step.end_us, t1}}) {
    if (b - a <= 0) continue;
    o << "<rect class=\"outside\" x=\"" << num(X(a)) << "\" y=\"" << num(kLaneTop - 4) << "\" width=\""
      << num((b - a) * scale) << "\" height=\"" << num(lanes_bottom - kLaneTop + 8)
      << "\" fill=\"#000000\" fill-opacity=\"0.08\" pointer-events=\"none\"/>\n";
  }
  for (const auto& [t, what, anchor] :
       {std::tuple<double, const char*, const char*>{step.begin_us, "begins", "start"}, {step.end_us, "ends", "end"}}) {
    o << "<line class=\"marker\" x1=\"" << num(X(t)) << "\" y1=\"" << num(kLaneTop - 14) << "\" x2=\"" << num(X(t))
      << "\" y2=\"" << num(lanes_bottom + 4) << "\" stroke=\"#444\" stroke-width=\"1\" stroke-dasharray=\"4 3\"/>\n";
    o << "<text class=\"marker-label\" x=\"" << num(X(t) + (anchor[0] == 's' ? 3 : -3)) << "\" y=\""
      << num(kLaneTop - 8) << "\" text-anchor=\"" << anchor << "\">forward " << step.forward << " " << what
      << "</text>\n";
  }
  o << "</g>\n";

  // Time axis: ms since the forward began (negative: before it, the early copies).
  const double ms0 = ms(t0), ms1 = ms(t1);
  const double stepv = tick_step(ms1 - ms0, 12);
  o << "<g id=\"axis\" data-x0=\"" << num(kLeft) << "\" data-x1=\"" << num(x_end) << "\" data-t0-ms=\"" << num(ms0, 3)
    << "\" data-t1-ms=\"" << num(ms1, 3) << "\">\n";
  o << "<line x1=\"" << num(kLeft) << "\" y1=\"" << num(kAxisY) << "\" x2=\"" << num(x_end) << "\" y2=\"" << num(kAxisY)
    << "\" stroke=\"#333\" stroke-width=\"1\"/>\n";
  const int prec = stepv >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(stepv)));
  for (double t = std::ceil(ms0 / stepv) * stepv; t <= ms1 + stepv * 1e-9; t += stepv) {
    const double x = kLeft + (t - ms0) / (ms1 - ms0) * kPlot;
    const double shown = std::abs(t) < stepv * 1e-9 ? 0.0 : t;
    o << "<line class=\"tick\" x1=\"" << num(x) << "\" y1=\"" << num(kAxisY) << "\" x2=\"" << num(x) << "\" y2=\""
      << num(kAxisY + 5) << "\" stroke=\"#333\" stroke-width=\"1\"/>";
    o << "<text class=\"tick-label\" x=\"" << num(x) << "\" y=\"" << num(kAxisY + 17) << "\" text-anchor=\"middle\">"
      << num(shown, prec) << "</text>\n";
  }
  o << "<text class=\"tick-label\" x=\"" << num(kLeft - 10) << "\" y=\"" << num(kAxisY + 17)
    << "\" text-anchor=\"end\">ms</text>\n";
  o << "<text class=\"tick-label\" x=\"" << num(kLeft + kPlot / 2) << "\" y=\"" << num(kAxisY + 33)
    << "\" text-anchor=\"middle\">time since forward " << step.forward << " began (ms)</text>\n";
  o << "</g>\n";

  // Legend.
  struct Item {
    const char* fill;
    std::string text;
  };
  const Item items[] = {{kResident, "resident layer"},
                        {kStreamed, "streamed layer"},
                        {kNext, "prefetch for the next forward"},
                        {"url(#stall-hatch)", "stall: compute waits for a copy (" + std::to_string(stall_boxes) + ")"},
                        {kOther, "another forward's work"},
                        {"#dedede", "outside this forward (veiled)"}};
  o << "<g id=\"legend\">\n";
  double lx = kLeft;
  for (const auto& it : items) {
    o << "<rect class=\"swatch\" x=\"" << num(lx) << "\" y=\"" << num(kLegendY - 10)
      << "\" width=\"14\" height=\"12\" fill=\"" << it.fill << "\" stroke=\"#666\" stroke-width=\"0.5\"/>";
    o << "<text class=\"legend-text\" x=\"" << num(lx + 19) << "\" y=\"" << num(kLegendY) << "\">"
      << xml_escape(it.text) << "</text>\n";
    lx += 19 + static_cast<double>(glyphs(it.text)) * 6.4 + 24;
  }
  o << "</g>\n";
  o << "</svg>\n";
  return o.str();
}

void write_timeline_svg_file(const std::string& svg, const std::string& path) {
  write_text_file(path, svg, "timeline");
}

}  // namespace sluice::offload
