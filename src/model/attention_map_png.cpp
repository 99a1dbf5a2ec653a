// The PNG of one layer's attention map (include/msa/attention_map.h): the layout and the
// colour scale are plain arithmetic; drawing, text and the PNG encoder are cairo's (built
// with MSA_WITH_CAIRO; without it the PNG functions throw and say so).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include "msa/attention_map.h"
#ifdef MSA_WITH_CAIRO
#include <cairo.h>
#endif

namespace msa {
namespace {

// The layout's fixed parts (pixels). The title band holds two lines, the caption band two.
constexpr int64_t kMargin = 14;
constexpr int64_t kTitleHeight = 52;
constexpr int64_t kCaptionHeight = 40;
constexpr int64_t kBarGap = 16, kBarWidth = 18, kBarLabelWidth = 96;
constexpr int64_t kMinBarHeight = 120;
// Wide enough for the title and the caption lines at their font sizes.
constexpr int64_t kMinWidth = 560;
// Without an image: the grid's longer side spans about this many pixels in square cells of a
// whole number of pixels, and a thin grid (1 x N) is stretched to at least kMinPanelSide.
constexpr int64_t kTargetPanelSide = 480, kMinPanelSide = 48;

// Colour-scale anchors, evenly spaced in t; brightness rises monotonically, so the scale
// also reads in grey.
constexpr std::array<std::array<double, 3>, 5> kAnchors = {{{13, 8, 48},
                                                           {92, 22, 110},
                                                           {186, 54, 85},
                                                           {243, 135, 47},
                                                           {252, 240, 170}}};

}  // namespace

std::array<uint8_t, 3> heatmap_colour(double t) {
  if (!(t > 0)) t = 0;  // also NaN
  if (t > 1) t = 1;
  const double x = t * (kAnchors.size() - 1);
  const size_t i = std::min(static_cast<size_t>(x), kAnchors.size() - 2);
  const double f = x - static_cast<double>(i);
  std::array<uint8_t, 3> out{};
  for (int ch = 0; ch < 3; ++ch)
    out[ch] = static_cast<uint8_t>(std::lround(kAnchors[i][ch] * (1 - f) + kAnchors[i + 1][ch] * f));
  return out;
}

HeatmapLayout heatmap_layout(int64_t rows, int64_t cols, const RgbImageView* image) {
  MSA_CHECK_ARG(rows >= 1 && cols >= 1 && rows <= kMaxHeatmapSide && cols <= kMaxHeatmapSide, "grid",
                "1 to " + std::to_string(kMaxHeatmapSide) + " rows and columns to render",
                std::to_string(rows) + "x" + std::to_string(cols));
  HeatmapLayout l;
  if (image) {
    MSA_CHECK_ARG(image->width >= 1 && image->height >= 1 && image->width <= kMaxHeatmapSide &&
                      image->height <= kMaxHeatmapSide,
                  "image", "1 to " + std::to_string(kMaxHeatmapSide) + " pixels per side",
                  std::to_string(image->width) + "x" + std::to_string(image->height));
    MSA_CHECK_ARG(static_cast<int64_t>(image->rgb.size()) == image->width * image->height * 3, "image",
                  std::to_string(image->width * image->height * 3) + " RGB bytes (width * height * 3)",
                  image->rgb.size());
    l.panel_width = image->width;
    l.panel_height = image->height;
  } else {
    const int64_t cell = std::max<int64_t>(1, kTargetPanelSide / std::max(rows, cols));
    const int64_t cell_w = std::max(cell, (kMinPanelSide + cols - 1) / cols);
    const int64_t cell_h = std::max(cell, (kMinPanelSide + rows - 1) / rows);
    l.panel_width = cols * cell_w;
    l.panel_height = rows * cell_h;
  }
  l.panel_x = kMargin;
  l.panel_y = kMargin + kTitleHeight;
  l.bar_x = l.panel_x + l.panel_width + kBarGap;
  l.bar_y = l.panel_y;
  l.bar_width = kBarWidth;
  l.bar_height = std::max(l.panel_height, kMinBarHeight);
  l.width = std::max(kMinWidth, l.bar_x + kBarWidth + kBarLabelWidth + kMargin);
  l.height = l.panel_y + l.bar_height + kCaptionHeight + kMargin;
  return l;
}

#ifndef MSA_WITH_CAIRO

bool attention_map_png_available() { return false; }

void write_attention_map_png(const std::string& path, const AttentionMap&, const LayerAttentionMap&,
                             const HeatmapPngOptions&) {
  throw Error("cannot write " + path + ": this build of msa has no PNG output (configure it with "
              "cairo: Debian libcairo2-dev)");
}

RgbImage read_rgb_png(const std::string& path) {
  throw Error("cannot read " + path + ": this build of msa has no PNG input (configure it with "
              "cairo: Debian libcairo2-dev)");
}

#else

namespace {

// Owns a cairo surface / context.
struct Surface {
  cairo_surface_t* s = nullptr;
  explicit Surface(cairo_surface_t* surface) : s(surface) {}
  ~Surface() { cairo_surface_destroy(s); }
  Surface(const Surface&) = delete;
  Surface& operator=(const Surface&) = delete;
};
struct Context {
  cairo_t* cr = nullptr;
  explicit Context(cairo_surface_t* surface) : cr(cairo_create(surface)) {}
  ~Context() { cairo_destroy(cr); }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
};

std::string format(const char* pattern, double value) {
  char text[64];
  std::snprintf(text, sizeof text, pattern, value);
  return text;
}

std::string percent(double share) { return std::isfinite(share) ? format("%.1f%%", 100 * share) : "n/a"; }

// "80-99" for a range, "3" for one value.
std::string range_label(int64_t begin, int64_t end_exclusive) {
  return end_exclusive - begin == 1 ? std::to_string(begin)
                                    : std::to_string(begin) + "-" + std::to_string(end_exclusive - 1);
}

// "0-15" when the heads are consecutive, else "0, 3, 7" (at most 6 listed).
std::string heads_label(const std::vector<int64_t>& heads) {
  if (heads.empty()) return "none";
  if (heads.back() - heads.front() + 1 == static_cast<int64_t>(heads.size()))
    return range_label(heads.front(), heads.back() + 1);
  std::string out;
  for (size_t i = 0; i < heads.size() && i < 6; ++i) out += (i ? ", " : "") + std::to_string(heads[i]);
  return heads.size() > 6 ? out + ", ..." : out;
}

void put_pixel(unsigned char* data, int stride, int64_t x, int64_t y, const std::array<uint8_t, 3>& rgb) {
  // CAIRO_FORMAT_RGB24: native-endian 32-bit words, 0x00RRGGBB.
  reinterpret_cast<uint32_t*>(data + y * stride)[x] =
      (uint32_t{rgb[0]} << 16) | (uint32_t{rgb[1]} << 8) | uint32_t{rgb[2]};
}

// Draws `s` with its baseline at y, shrinking the font (down to 60%) where the line would be
// wider than max_width.
void text(cairo_t* cr, double x, double y, const std::string& s, double size, double max_width,
          bool bold = false) {
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL,
                         bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
  cairo_text_extents_t extents;
  cairo_text_extents(cr, s.c_str(), &extents);
  if (extents.x_advance > max_width && extents.x_advance > 0)
    cairo_set_font_size(cr, std::max(0.6 * size, size * max_width / extents.x_advance));
  cairo_move_to(cr, x, y);
  cairo_show_text(cr, s.c_str());
}

void check_status(cairo_status_t status, const std::string& what) {
  if (status != CAIRO_STATUS_SUCCESS) throw Error(what + ": " + cairo_status_to_string(status));
}

}  // namespace

bool attention_map_png_available() { return true; }

void write_attention_map_png(const std::string& path, const AttentionMap& map,
                             const LayerAttentionMap& layer, const HeatmapPngOptions& options) {
  const AttentionMapSpec& spec = map.spec;
  const int64_t R = spec.grid_rows, C = spec.grid_cols;
  MSA_CHECK_ARG(static_cast<int64_t>(layer.heatmap.size()) == R * C, "layer.heatmap",
                std::to_string(R * C) + " values (the grid " + std::to_string(R) + "x" + std::to_string(C) + ")",
                layer.heatmap.size());
  MSA_CHECK_ARG(options.alpha >= 0 && options.alpha <= 1, "alpha", "a number in [0, 1]", options.alpha);
  const HeatmapLayout l = heatmap_layout(R, C, options.image);

  // The colour scale spans this layer's heatmap from its minimum to its maximum.
  double lo = INFINITY, hi = -INFINITY;
  for (double v : layer.heatmap)
    if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  if (!(lo <= hi)) lo = hi = 0;
  const auto scaled = [&](double v) { return hi > lo ? (v - lo) / (hi - lo) : 0.0; };

  Surface canvas(cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(l.width),
                                            static_cast<int>(l.height)));
  check_status(cairo_surface_status(canvas.s), "attention map " + path);
  Context ctx(canvas.s);
  cairo_t* cr = ctx.cr;
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  cairo_surface_flush(canvas.s);

  // The panel and the bar, pixel by pixel (exact colours, no filtering by cairo).
  unsigned char* data = cairo_image_surface_get_data(canvas.s);
  const int stride = cairo_image_surface_get_stride(canvas.s);
  const double alpha = options.image ? options.alpha : 1.0;
  for (int64_t y = 0; y < l.panel_height; ++y) {
    for (int64_t x = 0; x < l.panel_width; ++x) {
      double t;
      if (options.upsampling == HeatmapUpsampling::bilinear) {
        // Token centres at ((c + 0.5) / C, (r + 0.5) / R) of the panel; edges clamp.
        const double u = std::clamp((x + 0.5) * C / l.panel_width - 0.5, 0.0, C - 1.0);
        const double v = std::clamp((y + 0.5) * R / l.panel_height - 0.5, 0.0, R - 1.0);
        const int64_t c0 = static_cast<int64_t>(u), r0 = static_cast<int64_t>(v);
        const int64_t c1 = std::min(c0 + 1, C - 1), r1 = std::min(r0 + 1, R - 1);
        const double fu = u - c0, fv = v - r0;
        const auto at = [&](int64_t r, int64_t c) { return scaled(layer.heatmap[r * C + c]); };
        t = (1 - fv) * ((1 - fu) * at(r0, c0) + fu * at(r0, c1)) + fv * ((1 - fu) * at(r1, c0) + fu * at(r1, c1));
      } else {
        t = scaled(layer.heatmap[(y * R / l.panel_height) * C + x * C / l.panel_width]);
      }
      std::array<uint8_t, 3> rgb = heatmap_colour(t);
      if (options.image) {
        const uint8_t* under = options.image->rgb.data() + (y * options.image->width + x) * 3;
        for (int ch = 0; ch < 3; ++ch)
          rgb[ch] = static_cast<uint8_t>(std::lround((1 - alpha) * under[ch] + alpha * rgb[ch]));
      }
      put_pixel(data, stride, l.panel_x + x, l.panel_y + y, rgb);
    }
  }
  for (int64_t y = 0; y < l.bar_height; ++y) {  // maximum at the top
    const std::array<uint8_t, 3> rgb = heatmap_colour(1.0 - (y + 0.5) / l.bar_height);
    for (int64_t x = 0; x < l.bar_width; ++x) put_pixel(data, stride, l.bar_x + x, l.bar_y + y, rgb);
  }
  cairo_surface_mark_dirty(canvas.s);

  // Frames just outside the panel and the bar.
  cairo_set_source_rgb(cr, 0.55, 0.55, 0.55);
  cairo_set_line_width(cr, 1);
  cairo_rectangle(cr, l.panel_x - 0.5, l.panel_y - 0.5, l.panel_width + 1, l.panel_height + 1);
  cairo_rectangle(cr, l.bar_x - 0.5, l.bar_y - 0.5, l.bar_width + 1, l.bar_height + 1);
  cairo_stroke(cr);

  // Title: what the layer is and its share; subtitle: the baselines to read it against.
  cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
  const std::string kind = layer.sparse ? "MSA" : "dense";
  const double line = static_cast<double>(l.width - 2 * kMargin);
  text(cr, kMargin, kMargin + 17,
       "layer " + std::to_string(layer.layer) + " (" + kind + "): " + percent(layer.visual_mass_share) +
           " of the text queries' attention on the span",
       16, line, true);
  std::string subtitle = "uniform attention would give " + percent(map.uniform_visual_share);
  if (layer.sparse)
    subtitle += "; " + percent(layer.selected_visual_block_share) + " of selected blocks hold span tokens";
  text(cr, kMargin, kMargin + 40, subtitle, 12, line);

  // Colour-bar labels: the heatmap's maximum at the top, minimum at the bottom.
  const double label_x = static_cast<double>(l.bar_x + l.bar_width + 6);
  const double label_width = static_cast<double>(l.width - kMargin) - label_x;
  text(cr, label_x, l.bar_y + 11, format("%.3g", hi) + " max", 11, label_width);
  text(cr, label_x, l.bar_y + l.bar_height, format("%.3g", lo) + " min", 11, label_width);
  text(cr, label_x, l.bar_y + l.bar_height / 2.0 - 3, "attention", 11, label_width);
  text(cr, label_x, l.bar_y + l.bar_height / 2.0 + 11, "per token", 11, label_width);

  // Caption: what a cell is and over what the mean runs.
  const double caption_y = static_cast<double>(l.panel_y + l.bar_height);
  text(cr, kMargin, caption_y + 17,
       "cell = one span token (" + range_label(spec.span_begin, spec.span_end) + ", " +
           std::to_string(R) + " x " + std::to_string(C) + " grid, row-major); colour = mean attention it gets",
       11, line);
  const bool one_head = spec.heads.size() == 1, one_query = spec.query_end - spec.query_begin == 1;
  text(cr, kMargin, caption_y + 33,
       std::string("mean over ") + (one_head ? "head " : "heads ") + heads_label(spec.heads) +
           (one_query ? " and text query " : " and text queries ") +
           range_label(spec.query_begin, spec.query_end) + " (prompt of " + std::to_string(map.tokens) +
           " tokens" + (layer.sparse ? "; MSA: each attends over its selected blocks only)" : ")"),
       11, line);
  check_status(cairo_status(cr), "attention map " + path);
  check_status(cairo_surface_write_to_png(canvas.s, path.c_str()), "cannot write " + path);
}

RgbImage read_rgb_png(const std::string& path) {
  // The header first: signature, IHDR, width and height (big-endian), so that a huge image is
  // refused before cairo decodes (allocates) it.
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("image " + path + ": cannot open it");
  unsigned char header[24] = {};
  in.read(reinterpret_cast<char*>(header), sizeof header);
  static constexpr unsigned char kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (in.gcount() != sizeof header || !std::equal(kSignature, kSignature + 8, header) ||
      std::string(reinterpret_cast<char*>(header + 12), 4) != "IHDR")
    throw Error("image " + path + ": expected a PNG file (signature and IHDR header), got other bytes");
  const auto be32 = [&](int at) {
    return (int64_t{header[at]} << 24) | (int64_t{header[at + 1]} << 16) | (int64_t{header[at + 2]} << 8) |
           int64_t{header[at + 3]};
  };
  const int64_t width = be32(16), height = be32(20);
  if (width < 1 || height < 1 || width > kMaxHeatmapSide || height > kMaxHeatmapSide)
    throw Error("image " + path + ": expected 1 to " + std::to_string(kMaxHeatmapSide) +
                " pixels per side, got " + std::to_string(width) + "x" + std::to_string(height));
  in.close();

  Surface png(cairo_image_surface_create_from_png(path.c_str()));
  check_status(cairo_surface_status(png.s), "image " + path);
  if (cairo_image_surface_get_width(png.s) != width || cairo_image_surface_get_height(png.s) != height)
    throw Error("image " + path + ": the decoded size differs from its header");
  // Onto an opaque white RGB24 surface: any pixel format cairo decoded to, transparency
  // composited onto white.
  Surface rgb(cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(width), static_cast<int>(height)));
  check_status(cairo_surface_status(rgb.s), "image " + path);
  {
    Context ctx(rgb.s);
    cairo_set_source_rgb(ctx.cr, 1, 1, 1);
    cairo_paint(ctx.cr);
    cairo_set_source_surface(ctx.cr, png.s, 0, 0);
    cairo_paint(ctx.cr);
    check_status(cairo_status(ctx.cr), "image " + path);
  }
  cairo_surface_flush(rgb.s);
  const unsigned char* data = cairo_image_surface_get_data(rgb.s);
  const int stride = cairo_image_surface_get_stride(rgb.s);
  RgbImage out{.width = width, .height = height};
  out.rgb.resize(width * height * 3);
  for (int64_t y = 0; y < height; ++y)
    for (int64_t x = 0; x < width; ++x) {
      const uint32_t pixel = reinterpret_cast<const uint32_t*>(data + y * stride)[x];
      uint8_t* o = out.rgb.data() + (y * width + x) * 3;
      o[0] = static_cast<uint8_t>(pixel >> 16);
      o[1] = static_cast<uint8_t>(pixel >> 8);
      o[2] = static_cast<uint8_t>(pixel);
    }
  return out;
}

#endif  // MSA_WITH_CAIRO

}  // namespace msa
