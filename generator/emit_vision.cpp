// The convolution and pooling skeletons (templates/vision.cuh), forward and
// backward.
#include "emitter.h"

namespace cudagen::lowering {

// conv2d (templates/vision.cuh): tile.z walks images and groups; the
// tile form runs the implicit GEMM on the matmul tile, the direct form
// (a GEMM too thin for a tile: depthwise) one output element per thread.
// Stores go through store(), so an epilogue chain (bias, activation,
// residual add) fuses as after a matmul.
std::string Emitter::conv2d(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  const Param& weight = param(ps, "weight");
  const Param& out = param(ps, "out");
  const Param* bias = find_param(ps, "bias");
  const Shape& so = out.buffer->shape;
  const auto g = conv_geometry(t, x.buffer->shape, weight.buffer->shape, so);
  if (!g) return {};
  const int64_t B = g->B, C = g->C, H = g->H, W = g->W, O = g->O, OH = g->OH, OW = g->OW, groups = g->groups;
  const int64_t OG = g->OG, CG = g->CG;
  const int64_t K = CG * g->KH * g->KW, positions = g->OH * g->OW;
  const std::string& geometry = g->code;
  const std::string bias_term = bias ? " + " + load(*bias, "group * " + std::to_string(OG) + " + m") : "";
  const std::string hooks = fmt::format(
      "      [&](int m, int k) {{ return {}; }},\n"
      "      [&](int c, int h, int w) {{ return {}; }},\n",
      load(weight, fmt::format("w_base + (cg_i64)m * {} + k", K)),
      load(x, fmt::format("x_base + ((cg_i64)c * {} + h) * {} + w", H, W)));
  const std::string bases = fmt::format(
      "  const cg_i64 x_base = (image * {} + group * {}) * {}, w_base = group * {};\n", C, CG, H * W, OG * K);
  // A GEMM thinner than a tile in M, or shorter in K than one of its steps:
  // the direct form.
  if (OG < 8 || K < 16) {
    entry_function_ = "cg_conv2d_direct";
    const int64_t n = numel(so);
    ek.block = 256;
    ek.grid[0] = grid_stride_blocks(n, ek.block);
    ek.grid_stride = true;
    return geometry + fmt::format(
                          "  for (cg_i64 i = cg_global_thread(tile); i < {0}; i += cg_grid_threads(tile)) {{\n"
                          "    const int ow = (int)(i % {1}), oh = (int)(i / {1} % {2});\n"
                          "    const cg_i64 channel = i / {3} % {4}, image = i / ({3} * {4});\n"
                          "    const cg_i64 group = channel / {5};\n"
                          "    const int m = (int)(channel % {5});\n"
                          "  {6}"
                          "    const float acc = cg_conv2d_direct(\n{7}"
                          "        g, m, oh, ow);\n"
                          "    {8};\n"
                          "  }}\n",
                          n, OW, OH, positions, O, OG, bases, hooks, store(out, "i", "acc" + bias_term));
  }
  ek.block = 256;
  ek.grid[0] = int((positions + 31) / 32);
  ek.grid[1] = int((OG + 31) / 32);
  ek.grid[2] = int(B * groups);
  reserve_shared(ek, "the implicit GEMM's operand tiles", 4 * (32 * (16 + 1) + 16 * (32 + 1)));
  return "  CG_DYNAMIC_SMEM(cg_smem);\n" + geometry +
         fmt::format("  const cg_i64 image = tile.z / {0}, group = tile.z % {0};\n", groups) + bases +
         fmt::format("  const cg_i64 out_base = (image * {} + group * {}) * {};\n", O, OG, positions) +
         fmt::format(
             "  cg_conv2d_tile<32, 32, 16>(\n{}"
             "      [&](int m, int p, float acc) {{ {}; }},\n"
             "      g, tile.y, tile.x, (float*)cg_smem);\n",
             hooks, store(out, fmt::format("out_base + (cg_i64)m * {} + p", positions), "acc" + bias_term));
}

// conv2d_nhwc (templates/vision.cuh): on the pipelined mainloop where the
// fusion pass gave the kernel one (conv_gemm_mainloop_of), its patches
// copied into the A tile and the weight read as B (N x K); else the direct
// form, an output element a thread, channels fastest. Stores go through
// store(), so an epilogue chain (bias, activation, residual add) fuses.
std::string Emitter::conv2d_nhwc(int t, const GemmMainloop& gemm, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  const Param& weight = param(ps, "weight");
  const Param& out = param(ps, "out");
  const Shape& so = out.buffer->shape;
  const auto g = conv_geometry(t, x.buffer->shape, weight.buffer->shape, so, true);
  if (!g) return {};
  const int64_t K = g->KH * g->KW * g->CG, M = g->B * g->OH * g->OW;
  if (gemm.pipelined) {
    const GemmTile& tile = *gemm.pipelined;
    // A 1 x 1 convolution of stride 1 without padding reads x as it is: a
    // plain GEMM of the [M, C] pixels, its A copied as a matrix.
    const bool pointwise = g->KH == 1 && g->KW == 1 && arg_int(t, "stride_h", 1) == 1 &&
                           arg_int(t, "stride_w", 1) == 1 && arg_int(t, "padding_h", 0) == 0 &&
                           arg_int(t, "padding_w", 0) == 0;
    entry_function_ = pointwise ? "cg_gemm_mainloop" : "cg_conv2d_nhwc_mainloop";
    ek.matmul_path = fmt::format(
        "the pipelined mainloop (templates/gemm.cuh) as {}, {} (rule {} of templates/gemm_tuning.json)",
        pointwise ? "a plain GEMM (a 1 x 1 convolution)" : "an implicit GEMM", tile.describe(), tile.rule + 1);
    const std::string type = tile.tf32() ? "cg_tf32" : c_type(x.buffer->dtype);
    const bool grouped = g->groups > 1;
    const auto mainloop = [&](const std::string& k_begin, const std::string& k_end) {
      if (pointwise)
        return fmt::format(
            "  cg_gemm_mainloop<cg_config, {0}, true, true>(cg_acc, (const {0}*)x{1}, {2}, (const {0}*)weight{3}, {4},\n"
            "                                             {5}, {6}, {7}, {8}, tile.y, tile.x, ({0}*)cg_smem);\n",
            type, grouped ? fmt::format(" + z * {}", g->CG) : "", g->C, grouped ? fmt::format(" + z * {}", g->OG * K) : "",
            K, M, g->OG, k_begin, k_end);
      return g->code + fmt::format(
                           "  cg_conv2d_nhwc_mainloop<cg_config, {0}>(cg_acc, (const {0}*)x{5}, (const {0}*)weight{6}, g, "
                           "{1}, {2}, {3}, {4},\n"
                           "                                          tile.y, tile.x, ({0}*)cg_smem);\n",
                           type, M, g->OG, k_begin, k_end, grouped ? fmt::format(" + z * {}", g->CG) : "",
                           grouped ? fmt::format(" + z * {}", g->OG * K) : "");
    };
    // Grouped: the group's output channels, columns of out's rows.
    return pipelined_gemm(t, out, tile, M, g->OG, K, g->groups, group_bases(tile, grouped, g->OG), mainloop, ek, g->O);
  }
  // Depthwise (a channel a group, as many outputs) on whole 16-byte vectors
  // of channels: its own memory-bound form, outside a megakernel (whose
  // tiles share one block size and take no staged weights).
  const int vector = int(16 / dtype_bytes(x.buffer->dtype));
  if (g->groups == g->C && g->O == g->C && g->C % vector == 0 && !options_.megakernel &&
      x.bound->buffer != prologue_buffer_ && weight.bound->buffer != prologue_buffer_)
    return conv2d_nhwc_depthwise(*g, vector, gemm, x, weight, out, ek);
  ek.matmul_path = "the direct form (templates/vision.cuh): " + gemm.why_not_pipelined;
  const int64_t n = numel(so);
  ek.block = 256;
  ek.grid[0] = grid_stride_blocks(n, ek.block);
  ek.grid_stride = true;
  return g->code +
         fmt::format(
             "  for (cg_i64 i = cg_global_thread(tile); i < {0}; i += cg_grid_threads(tile)) {{\n"
             "    const cg_i64 o = i % {1}, pixel = i / {1};\n"
             "    const int ow = (int)(pixel % {2}), oh = (int)(pixel / {2} % {3});\n"
             "    const cg_i64 x_base = pixel / ({2} * {3}) * {4} + o / {5} * {6}, w_base = o * {7};\n"
             "    const float acc = cg_conv2d_nhwc_direct(\n"
             "        [&](int k) {{ return {8}; }},\n"
             "        [&](int h, int w, int c) {{ return {9}; }},\n"
             "        g, oh, ow);\n"
             "    {10};\n"
             "  }}\n",
             n, g->O, g->OW, g->OH, g->H * g->W * g->C, g->OG, g->CG, K, load(weight, "w_base + k"),
             load(x, fmt::format("x_base + ((cg_i64)h * {} + w) * {} + c", g->W, g->C)), store(out, "i", "acc"));
}

// conv2d_nhwc's depthwise form (cg_conv2d_nhwc_depthwise): a block holds
// up to 32 vectors of `vector` channels for 256 / that many consecutive
// output pixels a tile, its channels' weights staged in shared memory (at
// most 32 KiB: fewer vectors a block for large kernels), over enough tiles
// that the pixels it reads are at least 8 times its weights (a deep layer
// has few pixels a tile) where the grid stays 4 blocks a multiprocessor;
// a thread's V sums go out as one 16-byte store, or through the epilogue's
// vector form where it has one of that width.
std::string Emitter::conv2d_nhwc_depthwise(const ConvGeometry& g, int vector, const GemmMainloop& gemm, const Param& x,
                                           const Param& weight, const Param& out, EmittedKernel& ek) {
  const int64_t taps = g.KH * g.KW, vectors = g.C / vector, pixels = g.B * g.OH * g.OW;
  int64_t per_block = std::min<int64_t>(vectors, 32);
  auto staged_bytes = [&] { return taps * (per_block * vector + 4) * 4; };
  while (per_block > 1 && staged_bytes() > 32 * 1024) per_block = (per_block + 1) / 2;
  constexpr int kThreads = 256;
  const int64_t tile_pixels = kThreads / per_block, pixel_tiles = (pixels + tile_pixels - 1) / tile_pixels;
  // Tiles a block: enough that its pixels are 8 times its weights, but no
  // fewer blocks than 4 a multiprocessor of the target (a deep layer's few
  // pixels would otherwise leave most of them idle).
  const int64_t chunks = (vectors + per_block - 1) / per_block;
  const int64_t enough_blocks = 4 * device_model(options_.target()).sms;
  const int64_t tiles = std::clamp<int64_t>(std::min((8 * taps + tile_pixels - 1) / tile_pixels,
                                                     pixel_tiles * chunks / enough_blocks),
                                            1, pixel_tiles);
  ek.block = kThreads;
  ek.grid[0] = (pixel_tiles + tiles - 1) / tiles;
  ek.grid[1] = chunks;
  const int64_t offset = reserve_shared(ek, "the block's channels' weights, tap-major, as floats", staged_bytes());
  entry_function_ = "cg_conv2d_nhwc_depthwise";
  ek.matmul_path = fmt::format(
      "the depthwise form (templates/vision.cuh, memory-bound: {} channels a thread as one 16-byte vector, {} pixels "
      "x {} channels a block, {} time{}), not the tensor-core mainloop: {}",
      vector, tile_pixels, per_block * vector, tiles, tiles == 1 ? "" : "s", gemm.why_not_pipelined);
  std::string stored;
  if (out.bound->buffer == epilogue_buffer_ && epilogue_vector_width_ == vector) {
    vector_epilogue_used_ = true;
    stored = "cg_epilogue_vector(i, acc);";
  } else if (out.bound->buffer != epilogue_buffer_) {
    stored = store_vector_code(out, vector, "i", "acc");
  } else {
    stored = fmt::format("for (int w = 0; w < {}; ++w) {};", vector, store(out, "i + w", "acc[w]"));
  }
  return g.code + fmt::format(
                      "  CG_DYNAMIC_SMEM(cg_smem);\n"
                      "  cg_conv2d_nhwc_depthwise<{0}, {1}, {2}, {3}>(\n"
                      "      {4}, {8}, g, {5}, tile.x, {9}, (int)tile.y, {6},\n"
                      "      [&](cg_i64 i, const float* acc) {{\n"
                      "        {7}\n"
                      "      }});\n",
                      c_type(x.buffer->dtype), vector, per_block, kThreads, x.bound->name, pixels,
                      shared_floats(offset), stored, weight.bound->name, tiles);
}

// A convolution's implicit GEMMs are a product a group (tile.z, split-K's
// parts within it): `z`, the group, where the kernel needs it, and
// `out_base`, where the group's results start (group z times `per_group`).
// The product a pipelined GEMM's block computes: tile.z, less its part of k where split.
static std::string product_index(const GemmTile& tile) {
  return tile.split_k > 1 ? fmt::format("tile.z / {}", tile.split_k) : "tile.z";
}

std::string Emitter::group_bases(const GemmTile& tile, bool grouped, int64_t per_group) {
  const std::string z = product_index(tile);
  return grouped ? fmt::format("  const cg_i64 z = {}, out_base = z * {};  // group z\n", z, per_group)
         : tile.split_k > 1 ? "  // One product, its rows the output's.\n  const cg_i64 z = 0, out_base = 0;\n"
                            : "  const cg_i64 out_base = 0;  // one product, its rows the output's\n";
}

// conv2d_nhwc_backward_data (templates/vision.cuh): dx as a transposed
// convolution, on the pipelined mainloop where the fusion pass gave the
// kernel one (dout's taps gathered into A, the weight read as B stored
// K x N), a GEMM a class of dx's pixels where a stride splits it (z: the
// group, then the class; a block past its class's rows has nothing to do);
// else the direct form, an element of dx a thread, channels fastest.
std::string Emitter::conv2d_nhwc_backward_data(int t, const GemmMainloop& gemm, const std::vector<Param>& ps,
                                               EmittedKernel& ek) {
  const Param& weight = param(ps, "weight");
  const Param& dout = param(ps, "dout");
  const Param& dx = param(ps, "dx");
  const auto g = conv_geometry(t, dx.buffer->shape, weight.buffer->shape, dout.buffer->shape, true);
  if (!g) return {};
  const int64_t taps = g->KH * g->KW, M = g->B * g->H * g->W, K = taps * g->OG;
  if (gemm.pipelined) {
    const GemmTile& tile = *gemm.pipelined;
    const int64_t stride_h = arg_int(t, "stride_h", 1), stride_w = arg_int(t, "stride_w", 1);
    const DgradClasses classes =
        dgrad_classes(g->B, g->H, g->W, g->KH, g->KW, stride_h, stride_w, arg_int(t, "padding_h", 0),
                      arg_int(t, "padding_w", 0), arg_int(t, "dilation_h", 1), arg_int(t, "dilation_w", 1));
    const std::string type = tile.tf32() ? "cg_tf32" : c_type(dx.buffer->dtype);
    const bool grouped = g->groups > 1;
    if (classes.count > 1) return conv2d_nhwc_backward_data_classes(t, tile, *g, classes, type, dx, ek);
    entry_function_ = "cg_conv2d_nhwc_backward_data_mainloop";
    ek.matmul_path = fmt::format(
        "the pipelined mainloop (templates/gemm.cuh) as an implicit GEMM (the data gradient), {} (rule {} of "
        "templates/gemm_tuning.json)",
        tile.describe(), tile.rule + 1);
    const auto mainloop = [&](const std::string& k_begin, const std::string& k_end) {
      return g->code + fmt::format(
                           "  cg_conv2d_nhwc_backward_data_mainloop<cg_config, {0}>(cg_acc, (const {0}*)dout{1}, "
                           "(const {0}*)weight{2}, g,\n"
                           "                                                        {3}, {4}, {5}, {6}, tile.y, tile.x, "
                           "({0}*)cg_smem);\n",
                           type, grouped ? fmt::format(" + z * {}", g->OG) : "",
                           grouped ? fmt::format(" + z * {}", g->OG * taps * g->CG) : "", M, g->CG, k_begin, k_end);
    };
    // Grouped: the group's input channels, columns of dx's rows.
    return pipelined_gemm(t, dx, tile, M, g->CG, K, g->groups, group_bases(tile, grouped, g->CG), mainloop, ek, g->C);
  }
  ek.matmul_path = "the direct form (templates/vision.cuh): " + gemm.why_not_pipelined;
  const int64_t n = numel(dx.buffer->shape);
  ek.block = 256;
  ek.grid[0] = grid_stride_blocks(n, ek.block);
  ek.grid_stride = true;
  return g->code +
         fmt::format(
             "  for (cg_i64 i = cg_global_thread(tile); i < {0}; i += cg_grid_threads(tile)) {{\n"
             "    const cg_i64 c = i % {1}, pixel = i / {1}, group = c / {2};\n"
             "    const int w = (int)(pixel % {3}), h = (int)(pixel / {3} % {4});\n"
             "    const cg_i64 dout_base = pixel / ({3} * {4}) * {5} + group * {6}, w_base = group * {7} + c % {2};\n"
             "    const float acc = cg_conv2d_nhwc_backward_data_direct(\n"
             "        [&](int o, int tap) {{ return {8}; }},\n"
             "        [&](int oh, int ow, int o) {{ return {9}; }},\n"
             "        g, h, w);\n"
             "    {10};\n"
             "  }}\n",
             n, g->C, g->CG, g->W, g->H, g->OH * g->OW * g->O, g->OG, g->OG * taps * g->CG,
             load(weight, fmt::format("w_base + ((cg_i64)o * {} + tap) * {}", taps, g->CG)),
             load(dout, fmt::format("dout_base + ((cg_i64)oh * {} + ow) * {} + o", g->OW, g->O)), store(dx, "i", "acc"));
}

// A strided data gradient on the pipelined mainloop, split by its stride
// (cg_conv2d_dgrad_class): the product z is the group times the classes
// plus the class (split-K's partials and arrivals are a product's), and
// each class's rows are its pixels, stored where row() puts them.
std::string Emitter::conv2d_nhwc_backward_data_classes(int t, const GemmTile& tile, const ConvGeometry& g,
                                                       const DgradClasses& classes, const std::string& type,
                                                       const Param& dx, EmittedKernel& ek) {
  entry_function_ = "cg_conv2d_nhwc_backward_data_class_mainloop";
  ek.matmul_path = fmt::format(
      "the pipelined mainloop (templates/gemm.cuh) as an implicit GEMM (the data gradient), split by the stride into "
      "{} dense GEMMs, one a class of dx's pixels (up to {} pixels, {} taps), {} (rule {} of "
      "templates/gemm_tuning.json)",
      classes.count, classes.pixels, classes.taps, tile.describe(), tile.rule + 1);
  const bool grouped = g.groups > 1;
  const std::string z = product_index(tile);
  const std::string bases = fmt::format(
      "  const cg_i64 z = {0};  // the product: {1}the class of pixels\n"
      "{2}"
      "  const cg_conv2d_dgrad_class cg_class(g, {3}, (int)(z % {4}));\n"
      "  if (tile.y * {5} >= cg_class.M) return;  // past the class's pixels (classes differ by a row or column)\n",
      z, grouped ? "the group, then " : "",
      grouped ? fmt::format("  const cg_i64 group = z / {}, out_base = group * {};\n", classes.count, g.CG)
              : "  const cg_i64 out_base = 0;\n",
      g.B, classes.count, tile.bm);
  const auto mainloop = [&](const std::string& k_begin, const std::string& k_end) {
    return fmt::format(
        "  cg_conv2d_nhwc_backward_data_class_mainloop<cg_config, {0}>(cg_acc, (const {0}*)dout{1}, (const {0}*)weight{2},\n"
        "                                                              g, cg_class, {3}, {4}, {5}, tile.y, tile.x, ({0}*)cg_smem);\n",
        type, grouped ? fmt::format(" + group * {}", g.OG) : "",
        grouped ? fmt::format(" + group * {}", g.OG * g.KH * g.KW * g.CG) : "", g.CG, k_begin, k_end);
  };
  const GemmRows rows{"cg_class.M", "cg_class.row(g, m)"};
  // (The geometry first: the class is decoded from it.)
  return pipelined_gemm(t, dx, tile, classes.pixels, g.CG, classes.taps * g.OG, g.groups * classes.count,
                        g.code + bases, mainloop, ek, g.C, &rows);
}

// conv2d_nhwc_backward_weight (templates/vision.cuh): dweight over every
// image's pixels, on the pipelined mainloop where the fusion pass gave the
// kernel one (dout read as A stored K x M, the patches gathered into B),
// split over k where its tiles are few; else the direct form, an element
// of dweight a thread.
std::string Emitter::conv2d_nhwc_backward_weight(int t, const GemmMainloop& gemm, const std::vector<Param>& ps,
                                                 EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  const Param& dout = param(ps, "dout");
  const Param& dweight = param(ps, "dweight");
  const auto g = conv_geometry(t, x.buffer->shape, dweight.buffer->shape, dout.buffer->shape, true);
  if (!g) return {};
  const int64_t taps = g->KH * g->KW, N = taps * g->CG, K = g->B * g->OH * g->OW;
  if (gemm.pipelined) {
    const GemmTile& tile = *gemm.pipelined;
    entry_function_ = "cg_conv2d_nhwc_backward_weight_mainloop";
    ek.matmul_path = fmt::format(
        "the pipelined mainloop (templates/gemm.cuh) as an implicit GEMM (the weight gradient), {} (rule {} of "
        "templates/gemm_tuning.json)",
        tile.describe(), tile.rule + 1);
    const std::string type = tile.tf32() ? "cg_tf32" : c_type(x.buffer->dtype);
    const bool grouped = g->groups > 1;
    const auto mainloop = [&](const std::string& k_begin, const std::string& k_end) {
      return g->code + fmt::format(
                           "  cg_conv2d_nhwc_backward_weight_mainloop<cg_config, {0}>(cg_acc, (const {0}*)dout{1}, "
                           "(const {0}*)x{2}, g,\n"
                           "                                                          {3}, {4}, {5}, {6}, tile.y, "
                           "tile.x, ({0}*)cg_smem);\n",
                           type, grouped ? fmt::format(" + z * {}", g->OG) : "",
                           grouped ? fmt::format(" + z * {}", g->CG) : "", g->OG, N, k_begin, k_end);
    };
    // Grouped: the group's output channels, rows of dweight.
    return pipelined_gemm(t, dweight, tile, g->OG, N, K, g->groups, group_bases(tile, grouped, g->OG * N), mainloop,
                          ek);
  }
  ek.matmul_path = "the direct form (templates/vision.cuh): " + gemm.why_not_pipelined;
  const int64_t n = numel(dweight.buffer->shape);
  ek.block = 256;
  ek.grid[0] = grid_stride_blocks(n, ek.block);
  ek.grid_stride = true;
  return g->code +
         fmt::format(
             "  for (cg_i64 i = cg_global_thread(tile); i < {0}; i += cg_grid_threads(tile)) {{\n"
             "    const cg_i64 o = i / {1}, x_base = o / {2} * {3} + i % {3};\n"
             "    const int tap = (int)(i / {3} % {4});\n"
             "    const float acc = cg_conv2d_nhwc_backward_weight_direct(\n"
             "        [&](int b, int oh, int ow) {{ return {5}; }},\n"
             "        [&](int b, int h, int w) {{ return {6}; }},\n"
             "        g, {7}, tap / {8}, tap % {8});\n"
             "    {9};\n"
             "  }}\n",
             n, N, g->OG, g->CG, taps,
             load(dout, fmt::format("(((cg_i64)b * {} + oh) * {} + ow) * {} + o", g->OH, g->OW, g->O)),
             load(x, fmt::format("x_base + (((cg_i64)b * {} + h) * {} + w) * {}", g->H, g->W, g->C)), g->B, g->KW,
             store(dweight, "i", "acc"));
}

// A pooling task's window (forward or gradient: x's and out's shapes, or
// dx's and dout's): `const cg_pool2d_window p = {...};`. avg_pool2d has no
// dilation: 1.
std::string Emitter::pool_window(int t, const Shape& sx, const Shape& so) {
  return fmt::format("  const cg_pool2d_window p = {{{}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}}};\n",
                     sx[sx.size() - 2], sx.back(), so[so.size() - 2], so.back(), arg_int(t, "kernel_h", 1),
                     arg_int(t, "kernel_w", 1), arg_int(t, "stride_h", 1), arg_int(t, "stride_w", 1),
                     arg_int(t, "padding_h", 0), arg_int(t, "padding_w", 0), arg_int(t, "dilation_h", 1),
                     arg_int(t, "dilation_w", 1));
}

// max_pool2d, avg_pool2d: a grid-stride loop over the output; the template
// gives each element's value.
std::string Emitter::pool2d(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  const Param& out = param(ps, "out");
  const bool max = is_op(p_.tasks[size_t(t)], BundledOp::max_pool2d);
  const Shape& sx = x.buffer->shape;
  const Shape& so = out.buffer->shape;
  if (!args_at_least_one(t, {"stride_h", "stride_w", "kernel_h", "kernel_w"})) return {};
  const std::string window = pool_window(t, sx, so);
  const std::string value = max ? std::string("cg_max_pool2d(x, i, p)")
                                : fmt::format("cg_avg_pool2d(x, i, p, {})",
                                              arg_bool(t, "count_include_pad") ? "true" : "false");
  return window + grid_stride_loop(numel(so), store(out, "i", value), ek);
}

std::string Emitter::adaptive_avg_pool2d(int, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  const Param& out = param(ps, "out");
  const Shape& sx = x.buffer->shape;
  const Shape& so = out.buffer->shape;
  return grid_stride_loop(numel(so),
                          store(out, "i",
                                fmt::format("cg_adaptive_avg_pool2d(x, i, {}, {}, {}, {})", sx[sx.size() - 2],
                                            sx.back(), so[so.size() - 2], so.back())),
                          ek);
}

// An NHWC shape in the order pool_window reads (planes, then H and W last).
static Shape as_planes(const Shape& nhwc) { return {nhwc[0], nhwc[3], nhwc[1], nhwc[2]}; }

// max_pool2d_nhwc, avg_pool2d_nhwc, adaptive_avg_pool2d_nhwc: as their NCHW
// forms, an output element a thread, channels fastest.
std::string Emitter::pool2d_nhwc(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  const Param& out = param(ps, "out");
  const Shape& sx = x.buffer->shape;
  const Shape& so = out.buffer->shape;
  if (p_.tasks[size_t(t)].op->name == "adaptive_avg_pool2d_nhwc")
    return grid_stride_loop(numel(so),
                            store(out, "i",
                                  fmt::format("cg_adaptive_avg_pool2d_nhwc(x, i, {}, {}, {}, {}, {})", sx[1], sx[2],
                                              so[1], so[2], sx[3])),
                            ek);
  if (!args_at_least_one(t, {"stride_h", "stride_w", "kernel_h", "kernel_w"})) return {};
  const std::string value = is_op(p_.tasks[size_t(t)], BundledOp::max_pool2d_nhwc)
                                ? fmt::format("cg_max_pool2d_nhwc(x, i, p, {})", sx[3])
                                : fmt::format("cg_avg_pool2d_nhwc(x, i, p, {}, {})",
                                              arg_bool(t, "count_include_pad") ? "true" : "false", sx[3]);
  return pool_window(t, as_planes(sx), as_planes(so)) + grid_stride_loop(numel(so), store(out, "i", value), ek);
}

// The geometry of a convolution task (conv2d, or conv2d_backward with dout
// in out's place), checked: channels that split into groups, strides and
// dilations of at least 1. nullopt after a failure.
// nhwc: conv2d_nhwc's layouts (x and out channels-last, weight [O, KH, KW, CG]).
std::optional<Emitter::ConvGeometry> Emitter::conv_geometry(int t, const Shape& sx, const Shape& sw, const Shape& so,
                                                            bool nhwc) {
  ConvGeometry g;
  g.groups = arg_int(t, "groups", 1);
  if (nhwc)
    g.B = sx[0], g.H = sx[1], g.W = sx[2], g.C = sx[3], g.O = sw[0], g.KH = sw[1], g.KW = sw[2], g.OH = so[1], g.OW = so[2];
  else
    g.B = sx[0], g.C = sx[1], g.H = sx[2], g.W = sx[3], g.O = sw[0], g.KH = sw[2], g.KW = sw[3], g.OH = so[2], g.OW = so[3];
  if (g.groups < 1 || g.O % g.groups != 0) {
    fail(t, "weight", fmt::format("{} output channels do not split into {} groups", g.O, g.groups),
         "the output channels (weight's first dimension) must be a multiple of groups, as in PyTorch");
    return std::nullopt;
  }
  if (!args_at_least_one(t, {"stride_h", "stride_w", "dilation_h", "dilation_w"})) return std::nullopt;
  g.OG = g.O / g.groups, g.CG = g.C / g.groups;
  g.code = fmt::format(
      "  const cg_conv2d_geometry g = {{{}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}}};\n", g.C, g.H, g.W,
      g.O, g.OH, g.OW, g.KH, g.KW, arg_int(t, "stride_h", 1), arg_int(t, "stride_w", 1), arg_int(t, "padding_h", 0),
      arg_int(t, "padding_w", 0), arg_int(t, "dilation_h", 1), arg_int(t, "dilation_w", 1), g.groups);
  return g;
}

// conv2d_backward (templates/vision.cuh): one kernel of 256-thread blocks in
// up to three ranges, in order dx, dweight, dbias, each where the task asks
// for that gradient; a range's blocks are its GEMM's tiles (images and
// groups outermost), or for a GEMM too thin for a tile (depthwise) 256
// elements of the gradient a block, one a thread (the direct forms), or for
// dbias a channel a block. The ranges share no data: every block of the
// kernel runs at once, as norm_backward's rows and columns do.
std::string Emitter::conv2d_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  const Param& weight = param(ps, "weight");
  const Param& dout = param(ps, "dout");
  const Param* dx = find_param(ps, "dx");
  const Param* dweight = find_param(ps, "dweight");
  const Param* dbias = find_param(ps, "dbias");
  const auto geometry = conv_geometry(t, x.buffer->shape, weight.buffer->shape, dout.buffer->shape);
  if (!geometry) return {};
  const ConvGeometry& g = *geometry;
  if (dx == nullptr && dweight == nullptr && dbias == nullptr) {
    fail(t, "dx", "the task asks for none of dx, dweight and dbias", "bind at least one of them");
    return {};
  }
  const int64_t area = g.KH * g.KW, K = g.CG * area;
  // The hooks, within image b and the block's group.
  const std::string load_w = fmt::format("[&](int m, int k) {{ return {}; }}",
                                         load(weight, fmt::format("w_base + (cg_i64)m * {} + k", K)));
  const std::string load_dout =
      fmt::format("[&](int b, int o, int oh, int ow) {{ return {}; }}",
                  load(dout, fmt::format("((b * {} + group * {} + o) * (cg_i64){} + oh) * {} + ow", g.O, g.OG, g.OH, g.OW)));
  const std::string load_x =
      fmt::format("[&](int b, int c, int h, int w) {{ return {}; }}",
                  load(x, fmt::format("((b * {} + group * {} + c) * (cg_i64){} + h) * {} + w", g.C, g.CG, g.H, g.W)));
  ek.block = 256;
  std::string ranges;
  bool tiles = false;
  int64_t first = 0;  // the range's first block
  auto add_range = [&](int64_t blocks, const std::string& what, const std::string& code) {
    ranges += fmt::format("{}if (tile.x < {}) {{  // {}\n    const cg_i64 r = tile.x - {};\n{}  }}", ranges.empty() ? "  " : " else ",
                          first + blocks, what, first, code);
    first += blocks;
  };
  if (dx != nullptr) {
    const int64_t tiles_m = (g.CG + 31) / 32, tiles_n = (g.H * g.W + 31) / 32;
    const std::string bases = fmt::format("    const cg_i64 w_base = group * {};\n", g.OG * K);
    if (g.CG < 8 || g.OG * area < 16) {  // the direct form
      use_function(*p_.tasks[size_t(t)].op, "cg_conv2d_backward_data_direct");
      const int64_t n = numel(dx->buffer->shape);
      add_range((n + 255) / 256, "dx, an element a thread (the direct form)",
                fmt::format("    const cg_i64 i = r * 256 + threadIdx.x;\n"
                            "    if (i < {0}) {{\n"
                            "      const int w = (int)(i % {1}), h = (int)(i / {1} % {2});\n"
                            "      const cg_i64 channel = i / {3} % {4}, image = i / ({3} * {4}), group = channel / {5};\n"
                            "  {6}"
                            "      {7};\n"
                            "    }}\n",
                            n, g.W, g.H, g.H * g.W, g.C, g.CG, bases,
                            store(*dx, "i",
                                  fmt::format("cg_conv2d_backward_data_direct(\n"
                                              "          {},\n"
                                              "          {},\n"
                                              "          g, (int)image, (int)(channel % {}), h, w)",
                                              load_w, load_dout, g.CG))));
    } else {
      tiles = true;
      add_range(g.B * g.groups * tiles_m * tiles_n,
                fmt::format("dx, {} x {} tiles of 32 x 32 an image and group", tiles_m, tiles_n),
                fmt::format("    const cg_i64 z = r / {0}, image = z / {1}, group = z % {1};\n"
                            "{2}"
                            "    cg_conv2d_backward_data_tile<32, 32, 16>(\n"
                            "        {3},\n"
                            "        {4},\n"
                            "        [&](int c, int q, float acc) {{ {5}; }},\n"
                            "        g, (int)image, (int)(r % {0} / {6}), (int)(r % {6}), (float*)cg_smem);\n",
                            tiles_m * tiles_n, g.groups, bases, load_w, load_dout,
                            store(*dx, fmt::format("((image * {} + group * {} + c) * (cg_i64){}) + q", g.C, g.CG, g.H * g.W), "acc"),
                            tiles_n));
    }
  }
  if (dweight != nullptr) {
    const int64_t tiles_m = (g.OG + 31) / 32, tiles_n = (K + 31) / 32;
    if (g.OG < 8 || K < 16) {
      use_function(*p_.tasks[size_t(t)].op, "cg_conv2d_backward_weight_direct");
      const int64_t n = numel(dweight->buffer->shape);
      add_range((n + 255) / 256, "dweight, an element a thread (the direct form)",
                fmt::format("    const cg_i64 i = r * 256 + threadIdx.x;\n"
                            "    if (i < {0}) {{\n"
                            "      const int j = (int)(i % {1}), tap_h = (int)(i / {1} % {2}), channel_in = (int)(i / {3} % {4});\n"
                            "      const cg_i64 channel = i / {5}, group = channel / {6};\n"
                            "      {7};\n"
                            "    }}\n",
                            n, g.KW, g.KH, area, g.CG, K, g.OG,
                            store(*dweight, "i",
                                  fmt::format("cg_conv2d_backward_weight_direct(\n"
                                              "          {},\n"
                                              "          {},\n"
                                              "          g, {}, (int)(channel % {}), channel_in, tap_h, j)",
                                              load_dout, load_x, g.B, g.OG))));
    } else {
      tiles = true;
      use_function(*p_.tasks[size_t(t)].op, "cg_conv2d_backward_weight_tile");
      add_range(g.groups * tiles_m * tiles_n,
                fmt::format("dweight, {} x {} tiles of 32 x 32 a group, each over every image", tiles_m, tiles_n),
                fmt::format("    const cg_i64 group = r / {0};\n"
                            "    cg_conv2d_backward_weight_tile<32, 32, 16>(\n"
                            "        {1},\n"
                            "        {2},\n"
                            "        [&](int o, int k, float acc) {{ {3}; }},\n"
                            "        g, {4}, (int)(r % {0} / {5}), (int)(r % {5}), (float*)cg_smem);\n",
                            tiles_m * tiles_n, load_dout, load_x,
                            store(*dweight, fmt::format("(group * {} + o) * (cg_i64){} + k", g.OG, K), "acc"), g.B,
                            tiles_n));
    }
  }
  if (dbias != nullptr) {
    use_function(*p_.tasks[size_t(t)].op, "cg_conv2d_backward_bias");
    add_range(g.O, "dbias, a channel a block",
              fmt::format("    const cg_i64 group = r / {0};\n"
                          "    const float total = cg_conv2d_backward_bias(\n"
                          "        {1},\n"
                          "        g, {2}, (int)(r % {0}), (float*)cg_smem);\n"
                          "    if (threadIdx.x == 0) {3};\n",
                          g.OG, load_dout, g.B, store(*dbias, "r", "total")));
  }
  ek.grid[0] = first;
  // The tiles' operands, or the bias sums' 32 floats: a block runs one range.
  if (tiles)
    reserve_shared(ek, dbias != nullptr ? "the implicit GEMMs' operand tiles (dbias's blocks: 32 floats of scratch)"
                                        : "the implicit GEMMs' operand tiles",
                   4 * (32 * (16 + 1) + 16 * (32 + 1)));
  else if (dbias != nullptr)
    reserve_shared(ek, "dbias's block reduction scratch (32 floats)", 32 * 4);
  return (tiles || dbias != nullptr ? "  CG_DYNAMIC_SMEM(cg_smem);\n" : "") + g.code + ranges + "\n";
}

// max_pool2d_backward, avg_pool2d_backward: a grid-stride loop over dx, each
// element gathering the windows that cover it (templates/vision.cuh).
std::string Emitter::pool2d_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& dout = param(ps, "dout");
  const Param& dx = param(ps, "dx");
  const bool max = is_op(p_.tasks[size_t(t)], BundledOp::max_pool2d_backward);
  const Shape& sx = dx.buffer->shape;
  const Shape& so = dout.buffer->shape;
  if (!args_at_least_one(t, {"stride_h", "stride_w", "kernel_h", "kernel_w"})) return {};
  const std::string window = pool_window(t, sx, so);
  const std::string value = max ? std::string("cg_max_pool2d_backward(x, dout, i, p)")
                                : fmt::format("cg_avg_pool2d_backward(dout, i, p, {})",
                                              arg_bool(t, "count_include_pad") ? "true" : "false");
  if (max) use_function(*p_.tasks[size_t(t)].op, "cg_max_pool2d_choice");
  return window + grid_stride_loop(numel(sx), store(dx, "i", value), ek);
}

std::string Emitter::adaptive_avg_pool2d_backward(int, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& dout = param(ps, "dout");
  const Param& dx = param(ps, "dx");
  const Shape& sx = dx.buffer->shape;
  const Shape& so = dout.buffer->shape;
  return grid_stride_loop(numel(sx),
                          store(dx, "i",
                                fmt::format("cg_adaptive_avg_pool2d_backward(dout, i, {}, {}, {}, {})", sx[sx.size() - 2],
                                            sx.back(), so[so.size() - 2], so.back())),
                          ek);
}

// max_pool2d_nhwc_backward, avg_pool2d_nhwc_backward,
// adaptive_avg_pool2d_nhwc_backward: as their NCHW forms, a dx element a
// thread, channels fastest.
std::string Emitter::pool2d_nhwc_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& dout = param(ps, "dout");
  const Param& dx = param(ps, "dx");
  const Shape& sx = dx.buffer->shape;
  const Shape& so = dout.buffer->shape;
  if (p_.tasks[size_t(t)].op->name == "adaptive_avg_pool2d_nhwc_backward")
    return grid_stride_loop(numel(sx),
                            store(dx, "i",
                                  fmt::format("cg_adaptive_avg_pool2d_nhwc_backward(dout, i, {}, {}, {}, {}, {})", sx[1],
                                              sx[2], so[1], so[2], sx[3])),
                            ek);
  if (!args_at_least_one(t, {"stride_h", "stride_w", "kernel_h", "kernel_w"})) return {};
  const bool max = is_op(p_.tasks[size_t(t)], BundledOp::max_pool2d_nhwc_backward);
  const std::string value = max ? fmt::format("cg_max_pool2d_nhwc_backward(x, dout, i, p, {})", sx[3])
                                : fmt::format("cg_avg_pool2d_nhwc_backward(dout, i, p, {}, {})",
                                              arg_bool(t, "count_include_pad") ? "true" : "false", sx[3]);
  if (max) use_function(*p_.tasks[size_t(t)].op, "cg_max_pool2d_choice");
  return pool_window(t, as_planes(sx), as_planes(so)) + grid_stride_loop(numel(sx), store(dx, "i", value), ek);
}

// The element of channel `c` that a BatchNorm block's i-th is (NCHW).
static std::string channel_element(const Shape& s, const std::string& i) {
  const int64_t positions = s[2] * s[3];
  return fmt::format("({0} / {1} * {2} + c) * (cg_i64){1} + {0} % {1}", i, positions, s[1]);
}

// The statements that store channel c's batch statistics (`stats`, a
// cg_batchnorm2d_stats of `count` values a channel): mean and rstd, and the
// running statistics, where bound, moved toward the batch's by `momentum`.
std::string Emitter::batchnorm_statistics_stores(int t, const std::vector<Param>& ps, int64_t count) {
  const std::string momentum = float_arg(t, "momentum", 0.1);
  std::string code = fmt::format("{};\n{};\n", store(param(ps, "mean"), "c", "stats.mean"),
                                 store(param(ps, "rstd"), "c", "stats.rstd"));
  if (const Param* running_mean = find_param(ps, "running_mean"))
    code += fmt::format("{};\n", store(*running_mean, "c",
                                        fmt::format("(1.0f - {0}) * {1} + {0} * stats.mean", momentum,
                                                    load(*running_mean, "c"))));
  if (const Param* running_var = find_param(ps, "running_var"))  // toward the unbiased variance, as PyTorch keeps it
    code += fmt::format("{};\n", store(*running_var, "c",
                                        fmt::format("(1.0f - {0}) * {1} + {0} * stats.var * {2}", momentum,
                                                    load(*running_var, "c"), float_literal(double(count) / double(count - 1)))));
  return code;
}

// Indents each line of `code` by `spaces`.
static std::string indented(const std::string& code, int spaces) {
  std::string out;
  size_t begin = 0;
  while (begin < code.size()) {
    const size_t end = code.find('\n', begin);
    out += std::string(size_t(spaces), ' ') + code.substr(begin, end - begin + 1);
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return out;
}

// batchnorm2d (training mode), a block a channel (templates/vision.cuh):
// thread 0 stores the channel's statistics and moves the running ones.
std::string Emitter::batchnorm2d(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const Shape& s = x.buffer->shape;
  const int64_t count = s[0] * s[2] * s[3];
  if (count < 2) {
    fail(t, "x", fmt::format("x {} has {} value a channel; batch statistics need more than one", shape_to_string(s), count),
         "train with a larger batch or image, or use the BatchNorm in eval mode (its running statistics)");
    return {};
  }
  const Param* weight = find_param(ps, "weight");
  const Param* bias = find_param(ps, "bias");
  ek.block = 256;
  ek.grid[0] = s[1];
  reserve_shared(ek, "block reduction scratch (32 floats)", 32 * 4);
  const std::string at = channel_element(s, "i");
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 c = tile.x;\n"
      "  const cg_batchnorm2d_stats stats = cg_batchnorm2d_channel(\n"
      "      [&](cg_i64 i) {{ return {}; }},\n"
      "      [&](cg_i64 i, float v) {{ {}; }},\n"
      "      {}, {}, {}, {}, (float*)cg_smem);\n"
      "  if (threadIdx.x == 0) {{\n"
      "{}"
      "  }}\n",
      load(x, at), store(param(ps, "out"), at, "v"), count, weight ? load(*weight, "c") : "1.0f",
      bias ? load(*bias, "c") : "0.0f", float_arg(t, "eps", 1e-5), indented(batchnorm_statistics_stores(t, ps, count), 4));
}

// batchnorm2d_backward, a block a channel: dx where asked for, then thread 0
// stores the channel's dweight and dbias.
std::string Emitter::batchnorm2d_backward(int t, const std::vector<Param>& ps, EmittedKernel& ek) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const Shape& s = x.buffer->shape;
  const Param* weight = find_param(ps, "weight");
  const Param* dx = find_param(ps, "dx");
  const Param* dweight = find_param(ps, "dweight");
  const Param* dbias = find_param(ps, "dbias");
  ek.block = 256;
  ek.grid[0] = s[1];
  reserve_shared(ek, "block reduction scratch (32 floats)", 32 * 4);
  const std::string at = channel_element(s, "i");
  std::string sums;
  if (dweight != nullptr) sums += fmt::format("    {};\n", store(*dweight, "c", "sums.dweight"));
  if (dbias != nullptr) sums += fmt::format("    {};\n", store(*dbias, "c", "sums.dbias"));
  return fmt::format(
      "  CG_DYNAMIC_SMEM(cg_smem);\n"
      "  const cg_i64 c = tile.x;\n"
      "  const cg_batchnorm2d_sums sums = cg_batchnorm2d_backward_channel(\n"
      "      [&](cg_i64 i) {{ return {}; }},\n"
      "      [&](cg_i64 i) {{ return {}; }},\n"
      "      [&](cg_i64 i, float v) {{ {}; }},\n"
      "      {}, cg_load(mean, c), cg_load(rstd, c), {}, (float*)cg_smem);\n"
      "{}",
      load(x, at), load(param(ps, "dout"), at), dx ? store(*dx, at, "v") : "(void)i, (void)v",
      s[0] * s[2] * s[3], weight ? load(*weight, "c") : "1.0f",
      sums.empty() ? "  (void)sums;\n" : "  if (threadIdx.x == 0) {\n" + sums + "  }\n");
}

// A channels-last BatchNorm kernel's blocks, as batchnorm_nhwc_split lays
// them out: (split, chunk), with the rows' shared memory; where the pixels
// split, the workspace it merges them through (its parameters, returned).
std::vector<LaunchParam> Emitter::batchnorm_nhwc_blocks(const BatchNormNhwcSplit& s, EmittedKernel& ek) {
  ek.block = 256;
  ek.grid[0] = s.splits;
  ek.grid[1] = s.chunks;
  reserve_shared(ek, s.splits > 1 ? "each row of threads' two values a channel, and a word"
                                  : "each row of threads' two values a channel",
                 s.shared_bytes());
  if (s.splits == 1) return {};
  return {LaunchParam{"cg_partials", "float", -1, nullptr, true, split_k_.partials_offset, s.workspace_floats() * 4},
          LaunchParam{"cg_arrivals", "unsigned int", -1, nullptr, true, split_k_.arrivals_offset, s.chunks * 4}};
}

// A channels-last BatchNorm's first launch, where its pixels split over
// blocks (batchnorm_nhwc_split): `what` its statistics or sums, into the
// task's outputs (and the workspace), launched right before the group's
// own kernel (launches()), whose tile kernel is the next of `emitted`.
std::string Emitter::batchnorm_nhwc_pre_launch(const KernelGroup& k, const BatchNormNhwcSplit& s, const std::string& what,
                                               std::vector<LaunchParam> launch, const std::string& body, size_t index) {
  EmittedKernel ek = emitted_kernel(k);
  ek.name = k.name + (is_op(p_.tasks[size_t(k.tasks.front())], BundledOp::batchnorm2d_nhwc) ? "_statistics" : "_sums");
  for (LaunchParam& w : batchnorm_nhwc_blocks(s, ek)) launch.push_back(std::move(w));
  const std::string comment_text = fmt::format(
      "// Kernel {} ({} phase): {} of task {} (templates/vision.cuh), before kernel {}:\n"
      "//   {} pixels split {} ways ({} a block) over chunks of {} channels ({} of {} a thread), each split's\n"
      "//   results in the workspace, merged in split order by the chunk's last block.\n",
      ek.name, to_string(k.phase), what, p_.tasks[size_t(k.tasks.front())].task->id, k.name, s.pixels, s.splits,
      s.per_split, s.lanes * s.vector, s.vector, s.channels);
  std::string code = kernel_functions(comment_text, ek, launch, body);
  locate_params(ek, launch);
  pre_launches_[index] = {ek, std::move(launch)};
  return code;
}

// batchnorm2d_nhwc (training mode) as batchnorm_nhwc_split lays it out
// (templates/vision.cuh): one split, a block a chunk of channels computes
// their statistics and output; more, a statistics kernel first (pre_code)
// and this kernel normalising, on the same blocks.
std::string Emitter::batchnorm2d_nhwc(const KernelGroup& k, int t, const std::vector<Param>& ps, EmittedKernel& ek,
                                      size_t index, std::string& pre_code) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const BatchNormNhwcSplit s = batchnorm_nhwc_split(p_, t, options_.target(), options_.megakernel);
  if (s.pixels < 2) {
    fail(t, "x", fmt::format("x {} has {} value a channel; batch statistics need more than one",
                             shape_to_string(x.buffer->shape), s.pixels),
         "train with a larger batch or image, or use the BatchNorm in eval mode (its running statistics)");
    return {};
  }
  const std::string type = c_type(x.buffer->dtype);
  const Param* weight = find_param(ps, "weight");
  const Param* bias = find_param(ps, "bias");
  const std::string weight_ptr = weight ? weight->bound->name : fmt::format("(const {}*)nullptr", type);
  const std::string bias_ptr = bias ? bias->bound->name : fmt::format("(const {}*)nullptr", type);
  const std::string stats = indented(batchnorm_statistics_stores(t, ps, s.pixels), 8);
  const std::string stored = store_vector_code(param(ps, "out"), s.vector, "e", "values");
  const std::string eps = float_arg(t, "eps", 1e-5);
  if (s.splits == 1) {
    entry_function_ = "cg_batchnorm2d_nhwc_chunk";
    batchnorm_nhwc_blocks(s, ek);
    return fmt::format(
        "  CG_DYNAMIC_SMEM(cg_smem);\n"
        "  // {0} pixels, a block a chunk of {1} channels ({2} a thread): statistics, then the output.\n"
        "  cg_batchnorm2d_nhwc_chunk<{2}, {3}>({4}, {5}, {6}, {7}, {0}, tile.y, {8}, (float*)cg_smem,\n"
        "      [&](cg_i64 c, const cg_batchnorm2d_stats& stats) {{\n"
        "{9}"
        "      }},\n"
        "      [&](cg_i64 e, const float* values) {{\n"
        "        {10}\n"
        "      }});\n",
        s.pixels, s.lanes * s.vector, s.vector, s.lanes, x.bound->name, weight_ptr, bias_ptr, s.channels, eps, stats,
        stored);
  }
  std::vector<LaunchParam> launch;
  for (const char* slot : {"x", "mean", "rstd", "running_mean", "running_var"})
    if (const Param* p = find_param(ps, slot)) launch.push_back(buffer_param(p->bound->name, *p));
  pre_code = batchnorm_nhwc_pre_launch(
      k, s, "the batch statistics", std::move(launch),
      fmt::format("  CG_DYNAMIC_SMEM(cg_smem);\n"
                  "  cg_batchnorm2d_nhwc_statistics<{0}, {1}>({2}, {3}, {4}, {5}, (int)tile.x, {6}, tile.y, {7},\n"
                  "      cg_partials, cg_arrivals, (float*)cg_smem, [&](cg_i64 c, const cg_batchnorm2d_stats& stats) {{\n"
                  "{8}"
                  "      }});\n",
                  s.vector, s.lanes, x.bound->name, s.channels, s.pixels, s.per_split, s.splits, eps, stats),
      index);
  use_function(*p_.tasks[size_t(t)].op, "cg_batchnorm2d_nhwc_normalize");  // (the statistics kernel calls the entry)
  ek.block = 256;  // the statistics' blocks; no shared memory
  ek.grid[0] = s.splits;
  ek.grid[1] = s.chunks;
  return fmt::format(
      "  // {0} pixels split {1} ways ({2} a block) over chunks of {3} channels ({4} a thread), as the statistics.\n"
      "  cg_batchnorm2d_nhwc_normalize<{4}, {5}>({6}, {7}, {8}, {9}, {10}, {11}, {0}, {2}, (int)tile.x, tile.y,\n"
      "      [&](cg_i64 e, const float* values) {{\n"
      "        {12}\n"
      "      }});\n",
      s.pixels, s.splits, s.per_split, s.lanes * s.vector, s.vector, s.lanes, x.bound->name,
      param(ps, "mean").bound->name, param(ps, "rstd").bound->name, weight_ptr, bias_ptr, s.channels, stored);
}

// batchnorm2d_nhwc_backward, laid out as its forward: one split, a block a
// chunk sums its channels, then stores their dx; more, a sums kernel first
// (pre_code: dweight and dbias, and the f32 sums after the partials in the
// workspace) and this kernel's dx on the same blocks; with no dx asked for,
// the sums alone.
std::string Emitter::batchnorm2d_nhwc_backward(const KernelGroup& k, int t, const std::vector<Param>& ps,
                                               EmittedKernel& ek, size_t index, std::string& pre_code) {
  const Param& x = param(ps, "x");
  if (!check_f32_accumulation(t, x)) return {};
  const BatchNormNhwcSplit s = batchnorm_nhwc_split(p_, t, options_.target(), options_.megakernel);
  const std::string type = c_type(x.buffer->dtype);
  const Param* weight = find_param(ps, "weight");
  const Param* dx = find_param(ps, "dx");
  const std::string weight_ptr = weight ? weight->bound->name : fmt::format("(const {}*)nullptr", type);
  const std::string mean = param(ps, "mean").bound->name, rstd = param(ps, "rstd").bound->name,
                    dout = param(ps, "dout").bound->name;
  std::string sums;
  if (const Param* dweight = find_param(ps, "dweight")) sums += store(*dweight, "c", "sums.dweight") + ";\n";
  if (const Param* dbias = find_param(ps, "dbias")) sums += store(*dbias, "c", "sums.dbias") + ";\n";
  if (sums.empty()) sums = "(void)sums;\n";
  const std::string stored = dx ? store_vector_code(*dx, s.vector, "e", "values") : "(void)e, (void)values;";
  if (s.splits == 1) {
    entry_function_ = "cg_batchnorm2d_nhwc_backward_chunk";
    batchnorm_nhwc_blocks(s, ek);
    return fmt::format(
        "  CG_DYNAMIC_SMEM(cg_smem);\n"
        "  // {0} pixels, a block a chunk of {1} channels ({2} a thread): the sums, then dx.\n"
        "  cg_batchnorm2d_nhwc_backward_chunk<{2}, {3}>({4}, {5}, {6}, {7}, {8}, {9}, {0}, tile.y, (float*)cg_smem, {10},\n"
        "      [&](cg_i64 c, const cg_batchnorm2d_sums& sums) {{\n"
        "{11}"
        "      }},\n"
        "      [&](cg_i64 e, const float* values) {{\n"
        "        {12}\n"
        "      }});\n",
        s.pixels, s.lanes * s.vector, s.vector, s.lanes, x.bound->name, dout, mean, rstd, weight_ptr, s.channels,
        dx ? "true" : "false", indented(sums, 8), stored);
  }
  // The sums as dx reads them: f32, after the splits' partials.
  const int64_t sums_offset = 2 * s.splits * s.channels;
  if (dx != nullptr)
    sums += fmt::format("cg_store(cg_partials, {0} + c, sums.dweight);\ncg_store(cg_partials, {0} + {1} + c, sums.dbias);\n",
                        sums_offset, s.channels);
  const std::string sums_body =
      fmt::format("  CG_DYNAMIC_SMEM(cg_smem);\n"
                  "  cg_batchnorm2d_nhwc_gradient_sums<{0}, {1}>({2}, {3}, {4}, {5}, {6}, {7}, {8}, (int)tile.x, {9}, tile.y,\n"
                  "      cg_partials, cg_arrivals, (float*)cg_smem, [&](cg_i64 c, const cg_batchnorm2d_sums& sums) {{\n"
                  "{10}"
                  "      }});\n",
                  s.vector, s.lanes, x.bound->name, dout, mean, rstd, s.channels, s.pixels, s.per_split, s.splits,
                  indented(sums, 8));
  if (dx == nullptr) {  // the sums kernel is the group's own
    for (LaunchParam& w : batchnorm_nhwc_blocks(s, ek)) extra_params_.push_back(std::move(w));
    return sums_body;
  }
  std::vector<LaunchParam> launch;
  for (const char* slot : {"x", "dout", "mean", "rstd", "dweight", "dbias"})
    if (const Param* p = find_param(ps, slot)) launch.push_back(buffer_param(p->bound->name, *p));
  pre_code = batchnorm_nhwc_pre_launch(k, s, "the gradient's sums", std::move(launch), sums_body, index);
  extra_params_.push_back(LaunchParam{"cg_sums", "const float", -1, nullptr, false,
                                      split_k_.partials_offset + sums_offset * 4, 2 * s.channels * 4});
  use_function(*p_.tasks[size_t(t)].op, "cg_batchnorm2d_nhwc_backward_dx");  // (the sums kernel calls the entry)
  ek.block = 256;  // the sums' blocks; no shared memory
  ek.grid[0] = s.splits;
  ek.grid[1] = s.chunks;
  return fmt::format(
      "  // {0} pixels split {1} ways ({2} a block) over chunks of {3} channels ({4} a thread), as the sums.\n"
      "  cg_batchnorm2d_nhwc_backward_dx<{4}, {5}>({6}, {7}, {8}, {9}, {10}, cg_sums, {11}, {0}, {2}, (int)tile.x, tile.y,\n"
      "      [&](cg_i64 e, const float* values) {{\n"
      "        {12}\n"
      "      }});\n",
      s.pixels, s.splits, s.per_split, s.lanes * s.vector, s.vector, s.lanes, x.bound->name, dout, mean, rstd,
      weight_ptr, s.channels, stored);
}

}  // namespace cudagen::lowering
