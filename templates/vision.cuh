// Convolution, pooling and a general permute: the ops a convolutional network
// (torchvision's ResNet, MobileNet) needs, NCHW, and the convolution on
// channels-last (NHWC) tensors that runs on tensor cores.

// The sizes of one 2-D convolution, as the emitter writes them into the kernel.
struct cg_conv2d_geometry {
  int C, H, W;    // input channels (all groups), height, width
  int O, OH, OW;  // output channels (all groups), height, width
  int KH, KW, stride_h, stride_w, padding_h, padding_w, dilation_h, dilation_w, groups;
};

// 2-D convolution as an implicit GEMM: for one image and one group, with
// OG = O / groups output channels and CG = C / groups input channels,
//   out[m, p] = sum over k of weight[m, k] * patch(k, p),
// M = OG, N = OH * OW, K = CG * KH * KW, k = (c, i, j), p = (oh, ow), and
//   patch(k, p) = x[c, oh * stride_h - padding_h + i * dilation_h, ow * stride_w - padding_w + j * dilation_w]
// (0 outside the image). No im2col buffer: the matmul tile's operand load
// computes patch() on the fly. The skeleton's hooks say where the image and
// the group are: load_w(m, k), load_x(c, h, w) within them, and
// epilogue(m, p, acc), where fusion puts the bias, activation and residual.
template <int BM, int BN, int BK, typename LoadW, typename LoadX, typename Epilogue>
CG_OP("conv2d",
      "pattern: opaque",
      "autocast: low",
      "epilogue: out",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: bias weight T optional",
      "tensor: out output T",
      "arg: stride_h int = 1",
      "arg: stride_w int = 1",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: dilation_h int = 1",
      "arg: dilation_w int = 1",
      "arg: groups int = 1",
      "shape: x:[B, groups * CG, H, W] weight:[O, CG, KH, KW] bias:[O] -> out:[B, O, (H + 2 * padding_h - dilation_h * (KH - 1) - 1) / stride_h + 1, (W + 2 * padding_w - dilation_w * (KW - 1) - 1) / stride_w + 1]",
      "smem: 4 * (BM * (BK + 1) + BK * (BN + 1))",
      "variant: cg_conv2d_direct",
      "backward: conv2d_backward",
      "flops: 2 * numel(out) * CG * KH * KW",
      "doc: torch.nn.functional.conv2d (NCHW; stride, padding, dilation, groups, depthwise included) as an implicit GEMM on the matmul tile; f16/bf16 accumulate in f32")
CG_DEVICE void cg_conv2d_tile(LoadW load_w, LoadX load_x, Epilogue epilogue, cg_conv2d_geometry g, int tile_m,
                              int tile_n, float* smem) {
  const int kernel_area = g.KH * g.KW;
  cg_matmul_tile<BM, BN, BK>(
      load_w,
      [&](int k, int n) {
        const int c = k / kernel_area, r = k % kernel_area, oh = n / g.OW, ow = n % g.OW;
        const int h = oh * g.stride_h - g.padding_h + (r / g.KW) * g.dilation_h;
        const int w = ow * g.stride_w - g.padding_w + (r % g.KW) * g.dilation_w;
        return h >= 0 && h < g.H && w >= 0 && w < g.W ? load_x(c, h, w) : 0.0f;
      },
      epilogue, g.O / g.groups, g.OH * g.OW, g.C / g.groups * kernel_area, tile_m, tile_n, smem);
}

// The direct form, one output element per call: for GEMMs too thin for a
// tile (a depthwise convolution has M = 1 and K = KH * KW), where the tile
// would compute 32 rows to keep one.
template <typename LoadW, typename LoadX>
CG_DEVICE float cg_conv2d_direct(LoadW load_w, LoadX load_x, cg_conv2d_geometry g, int m, int oh, int ow) {
  float acc = 0.0f;
  const int channels = g.C / g.groups;
  for (int c = 0; c < channels; ++c)
    for (int i = 0; i < g.KH; ++i) {
      const int h = oh * g.stride_h - g.padding_h + i * g.dilation_h;
      if (h < 0 || h >= g.H) continue;
      for (int j = 0; j < g.KW; ++j) {
        const int w = ow * g.stride_w - g.padding_w + j * g.dilation_w;
        if (w >= 0 && w < g.W) acc += load_w(m, (c * g.KH + i) * g.KW + j) * load_x(c, h, w);
      }
    }
  return acc;
}

// ---------------------------------------------------------------------------
// Convolution on channels-last tensors (conv2d_nhwc): x [B, H, W, C], weight
// [O, KH, KW, CG], out [B, OH, OW, O]. For one group, with OG = O / groups
// output channels and CG = C / groups input channels, an implicit GEMM
//   out[m, n] = sum over k of patch(m, k) * weight[n, k],
// M = B * OH * OW (m = (image, oh, ow): out's rows), N = OG, K = KH * KW *
// CG (k = (i, j, c), c fastest: the weight's own order), and
//   patch(m, k) = x[image, oh * stride_h - padding_h + i * dilation_h, ow * stride_w - padding_w + j * dilation_w, c]
// (0 outside the image). Channels are the contiguous axis of both operands:
// where CG is a multiple of 16 bytes of elements, 16 bytes of k at one tap
// (i, j) are 16 consecutive bytes of one pixel, so the pipelined
// tensor-core mainloop (templates/gemm.cuh) copies patches into its A tile
// by cp.async as it copies a matrix (cg_conv2d_nhwc_patches), and reads the
// weight as a B operand stored N x K. Elsewhere (f32 without TF32, CG not
// whole 16 bytes, groups, a megakernel) the direct form runs.

// The A copier of cg_gemm_mainloop_with for a convolution's patches: thread
// t copies the chunks of cg_gemm_operand's copier (one column of the [BM][BK]
// tile, rows row_stride apart), each from the pixel its row's window covers
// at the k-tile's tap, or zeros where that lies outside the image, past M or
// past k_end. The window corners are computed once a tile; a k-tile costs a
// thread one division of k into (tap, channel) and, a chunk, two compares
// and the cp.async.
template <int BM, int BK, typename T, int THREADS>
struct cg_conv2d_nhwc_patches {
  typedef cg_gemm_operand<BM, BK, true, T> operand;
  typedef typename operand::template copy_layout<THREADS> layout;
  static constexpr int per_thread = layout::per_thread, row_stride = layout::row_stride;
  // A row past M: a corner row no tap reaches, so that every chunk of it is outside.
  static constexpr int outside = -(1 << 30);
  const T* x;               // the group's first channel of the first pixel
  cg_conv2d_geometry g;
  cg_i64 corner[per_thread];           // offset of each row's window corner (which may lie outside the image)
  int top[per_thread], left[per_thread];  // that corner's row and column in the image
  cg_i64 k_first, k_end;    // this thread's chunk's k at k-tile 0; the end of k
  int smem_offset;          // of its first chunk in a stage's tile

  CG_DEVICE cg_conv2d_nhwc_patches(const T* x_group, const cg_conv2d_geometry& geometry, cg_i64 M, cg_i64 m0,
                                   cg_i64 k_begin, cg_i64 k_end_)
      : x(x_group), g(geometry), k_end(k_end_) {
    const int row = layout::row(), col = layout::col();
    k_first = k_begin + col;
    smem_offset = operand::tile::offset(row, col);
    CG_UNROLL
    for (int i = 0; i < per_thread; ++i) {
      const cg_i64 m = m0 + row + (cg_i64)i * row_stride;
      const cg_i64 ow = m % g.OW, rest = m / g.OW, oh = rest % g.OH, image = rest / g.OH;
      top[i] = m < M ? (int)oh * g.stride_h - g.padding_h : outside;
      left[i] = (int)ow * g.stride_w - g.padding_w;
      corner[i] = ((image * g.H + top[i]) * g.W + left[i]) * g.C;
    }
  }

  // Issues the cp.async of k-tile kt into the stage's tile at shared address `dst`.
  CG_DEVICE void copy(unsigned int dst, cg_i64 kt) const {
    const cg_i64 k = k_first + kt * BK;
    const int CG = g.C / g.groups;
    const int c = (int)(k % CG), tap = (int)(k / CG);
    const int dh = (tap / g.KW) * g.dilation_h, dw = (tap % g.KW) * g.dilation_w;
    const cg_i64 step = ((cg_i64)dh * g.W + dw) * g.C + c;
    const bool k_inside = k < k_end;  // (CG whole chunks: a chunk is wholly inside or past K)
    CG_UNROLL
    for (int i = 0; i < per_thread; ++i) {
      const int h = top[i] + dh, w = left[i] + dw;
      const bool inside = k_inside && (unsigned)h < (unsigned)g.H && (unsigned)w < (unsigned)g.W;
      cg_cp_async_16_at(dst + (unsigned int)(layout::offset(smem_offset, i) * (int)sizeof(T)),
                        inside ? x + corner[i] + step : x, inside ? 16 : 0);
    }
  }
};

// The tile (tile_m, tile_n) of one group's implicit GEMM, over k in
// [k_begin, k_end), into acc, on the pipelined mainloop. x_group points at
// the group's first channel of the first pixel, w_group at its first output
// channel's weights; T is cg_f16, cg_bf16 or cg_tf32 (f32 under
// --allow-tf32). M = B * OH * OW, N = OG.
template <typename Config, typename T>
CG_DEVICE void cg_conv2d_nhwc_mainloop(cg_gemm_accumulators<Config>& acc, const T* x_group, const T* w_group,
                                       const cg_conv2d_geometry& g, cg_i64 M, cg_i64 N, cg_i64 k_begin, cg_i64 k_end,
                                       cg_i64 tile_m, cg_i64 tile_n, T* smem) {
  const cg_i64 K = (cg_i64)g.KH * g.KW * (g.C / g.groups);
  const cg_conv2d_nhwc_patches<Config::BM, Config::BK, T, Config::THREADS> copy_a(x_group, g, M, tile_m * Config::BM,
                                                                                 k_begin, k_end);
  const typename cg_gemm_operand<Config::BN, Config::BK, true, T>::template copier<Config::THREADS> copy_b(
      w_group, K, tile_n * Config::BN, N, k_begin, k_end);
  cg_gemm_mainloop_with<Config, T, true, true>(acc, copy_a, copy_b, (k_end - k_begin + Config::BK - 1) / Config::BK,
                                                smem);
}

// Depthwise convolution on channels-last tensors (groups = C = O: a group
// of one input channel and one output channel), the form conv2d_nhwc takes
// for it where C is whole V-channel vectors (16 bytes of T): memory-bound,
// each element of x read by up to KH x KW outputs, so the aim is every byte
// of x and out moved once from DRAM in whole sectors. A block holds CV
// vectors of channels (chunk `chunk`, CV * V channels) for `tiles` tiles of
// THREADS / CV consecutive output pixels: a thread computes V channels of
// one pixel a tile, reading x a 16-byte vector a tap (a warp's loads are
// runs of a pixel's channels, consecutive pixels side by side; the taps'
// reuse of x hits in L1). The chunk's weights, [C, KH, KW, 1] in memory,
// are staged once a block in `w_smem` as floats, tap-major with rows of
// CV * V + 4 (read in memory order; the 4 spread a warp's stores over the
// banks), so that a tap's V weights are one vector too; `tiles` is chosen
// so that a block's x outweighs them. store(i, acc) gets out's index of the
// thread's first channel and its V sums (pixels past `pixels`, the output's
// B * OH * OW, and channels past C skipped).
template <typename T, int V, int CV, int THREADS, typename Store>
CG_DEVICE void cg_conv2d_nhwc_depthwise(const T* x, const T* weight, const cg_conv2d_geometry& g, cg_i64 pixels,
                                        cg_i64 block_tile, int tiles, int chunk, float* w_smem, Store store) {
  constexpr int CHANNELS = CV * V, LD = CHANNELS + 4, PIXELS = THREADS / CV;
  const int taps = g.KH * g.KW, c0 = chunk * CHANNELS;
  const int staged = (g.C - c0 < CHANNELS ? g.C - c0 : CHANNELS) * taps;  // the chunk's weights, contiguous
  for (int e = threadIdx.x; e < staged; e += THREADS)
    w_smem[(e % taps) * LD + e / taps] = cg_widen(cg_load(weight, (cg_i64)c0 * taps + e));
  __syncthreads();
  if (threadIdx.x >= PIXELS * CV) return;  // (where CV does not divide THREADS)
  const int cv = threadIdx.x % CV, c = c0 + cv * V;
  if (c >= g.C) return;
  for (int t = 0; t < tiles; ++t) {
    const cg_i64 pixel = (block_tile * tiles + t) * PIXELS + threadIdx.x / CV;
    if (pixel >= pixels) return;
    const int ow = (int)(pixel % g.OW), oh = (int)(pixel / g.OW % g.OH);
    const cg_i64 image_base = pixel / ((cg_i64)g.OW * g.OH) * g.H * g.W;
    float acc[V];
    CG_UNROLL
    for (int v = 0; v < V; ++v) acc[v] = 0.0f;
    for (int i = 0; i < g.KH; ++i) {
      const int h = oh * g.stride_h - g.padding_h + i * g.dilation_h;
      if (h < 0 || h >= g.H) continue;
      for (int j = 0; j < g.KW; ++j) {
        const int w = ow * g.stride_w - g.padding_w + j * g.dilation_w;
        if (w < 0 || w >= g.W) continue;
        const cg_vector<V, T> xv = cg_load_vector<V>(x, (image_base + (cg_i64)h * g.W + w) * g.C + c);
        const float* wt = w_smem + (i * g.KW + j) * LD + cv * V;
        CG_UNROLL
        for (int v = 0; v < V; ++v) acc[v] += wt[v] * cg_widen(xv.v[v]);
      }
    }
    store(pixel * g.C + c, acc);
  }
}

// The direct form, one output element per call: out[image, oh, ow, o] for
// the output channel whose weights load_w(k) reads (k = (i, j, c) as
// above), load_x(h, w, c) reading channel c of the group at pixel (h, w)
// of the image.
template <typename LoadW, typename LoadX>
CG_OP("conv2d_nhwc",
      "pattern: opaque",
      "autocast: low",
      "epilogue: out",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: out output T",
      "arg: stride_h int = 1",
      "arg: stride_w int = 1",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: dilation_h int = 1",
      "arg: dilation_w int = 1",
      "arg: groups int = 1",
      "shape: x:[B, H, W, groups * CG] weight:[O, KH, KW, CG] -> out:[B, (H + 2 * padding_h - dilation_h * (KH - 1) - 1) / stride_h + 1, (W + 2 * padding_w - dilation_w * (KW - 1) - 1) / stride_w + 1, O]",
      "variant: cg_conv2d_nhwc_mainloop",
      "variant: cg_gemm_mainloop",
      "variant: cg_gemm_config",
      "variant: cg_gemm_each_coalesced",
      "variant: cg_gemm_each_coalesced_vector",
      "variant: cg_gemm_split_k",
      "variant: cg_conv2d_nhwc_depthwise",
      "backward: conv2d_nhwc_backward_data conv2d_nhwc_backward_weight",
      "flops: 2 * numel(out) * CG * KH * KW",
      "doc: torch.nn.functional.conv2d on channels-last tensors (x NHWC, weight [O, KH, KW, CG], out NHWC; stride, padding, dilation, groups; no bias: add one after it, which fuses) as an implicit GEMM, on the tensor-core mainloop where CG is whole 16 bytes; f16/bf16 accumulate in f32")
CG_DEVICE float cg_conv2d_nhwc_direct(LoadW load_w, LoadX load_x, cg_conv2d_geometry g, int oh, int ow) {
  float acc = 0.0f;
  const int channels = g.C / g.groups;
  for (int i = 0; i < g.KH; ++i) {
    const int h = oh * g.stride_h - g.padding_h + i * g.dilation_h;
    if (h < 0 || h >= g.H) continue;
    for (int j = 0; j < g.KW; ++j) {
      const int w = ow * g.stride_w - g.padding_w + j * g.dilation_w;
      if (w < 0 || w >= g.W) continue;
      const int tap = (i * g.KW + j) * channels;
      for (int c = 0; c < channels; ++c) acc += load_w(tap + c) * load_x(h, w, c);
    }
  }
  return acc;
}

// ---------------------------------------------------------------------------
// conv2d_nhwc's gradients, two ops the derive pass links to it, each an
// implicit GEMM of its own (its own tile, split-K where its output tiles
// are few), for one group:
//  - dx (conv2d_nhwc_backward_data), a transposed convolution:
//      dx[m, n] = sum over k of dout_at(m, k) * weight[o, i, j, n],
//    M = B * H * W (m = (image, h, w): dx's rows), N = CG, K = KH * KW * OG
//    (k = (i, j, o), o fastest), where dout_at(m, k) is dout[image, oh, ow, o]
//    for the output pixel whose window puts tap (i, j) on (h, w): oh = (h +
//    padding_h - i * dilation_h) / stride_h where that divides exactly and
//    lies in the output, else 0. A is dout gathered K-contiguous (output
//    channels), B the weight read N-contiguous (input channels);
//  - dweight (conv2d_nhwc_backward_weight), over every image's pixels:
//      dweight[o, n] = sum over k of dout[k, o] * patch(k, n),
//    M = OG, N = KH * KW * CG (n = (i, j, c): the weight's own order), K = B
//    * OH * OW (k = (image, oh, ow)), patch as in conv2d_nhwc. A is dout as
//    stored (K x M, output channels contiguous), B the patches gathered
//    N-contiguous (input channels).
// Both on the pipelined mainloop where OG and CG are whole 16-byte chunks;
// each sum runs in a fixed order (split-K's parts added in order): the same
// bits every run. A stride s > 1 (dilation 1) splits dx's GEMM by the stride
// (cg_conv2d_dgrad_class): one dense GEMM a class of dx's pixels, over the
// taps that reach them, where the undivided GEMM would multiply zeros for
// the taps that do not divide (about (s^2 - 1) / s^2 of its k). With
// dilation, the undivided one runs, its zeros included.

// The gathers below index pixels and k in 32 bits (the fusion pass keeps
// the GEMMs' M, N and K under 2^31 on this path): a division by one of the
// geometry's constants is then a multiply-high, where a 64-bit one is a
// call. Element offsets stay 64-bit.

// dx's A copier: for each of a thread's rows (dx's pixel m), dout at the
// output pixel whose window puts tap (i, j) of the k-tile's k = (i, j, o) on
// m, or zeros. As the forward's patch copier: each row's pixel is decoded
// once a tile (where its windows' taps start, `top`/`left` with the padding
// added, and its image's first dout pixel); a k-tile costs a thread one
// division of k into (tap, channel) and, a chunk, the stride's divisibility
// and bounds compares and the cp.async.
template <int BM, int BK, typename T, int THREADS>
struct cg_conv2d_nhwc_dout_taps {
  typedef cg_gemm_operand<BM, BK, true, T> operand;
  typedef typename operand::template copy_layout<THREADS> layout;
  static constexpr int per_thread = layout::per_thread, row_stride = layout::row_stride;
  // A row past M: one that no tap reaches (every chunk of it is zeros).
  static constexpr int outside = -(1 << 30);
  const T* dout;            // the group's first output channel of the first pixel
  cg_conv2d_geometry g;
  cg_i64 image_base[per_thread];          // offset of each row's image's first dout pixel
  int top[per_thread], left[per_thread];  // h + padding_h, w + padding_w of each row's pixel
  unsigned int k_first, k_end;            // this thread's chunk's k at k-tile 0; the end of k
  int smem_offset;                        // of its first chunk in a stage's tile

  CG_DEVICE cg_conv2d_nhwc_dout_taps(const T* dout_group, const cg_conv2d_geometry& geometry, cg_i64 M, cg_i64 m0,
                                     cg_i64 k_begin, cg_i64 k_end_)
      : dout(dout_group), g(geometry), k_end((unsigned int)k_end_) {
    const int row = layout::row(), col = layout::col();
    k_first = (unsigned int)k_begin + col;
    smem_offset = operand::tile::offset(row, col);
    CG_UNROLL
    for (int i = 0; i < per_thread; ++i) {
      const unsigned int m = (unsigned int)(m0 + row + i * row_stride);
      const int w = (int)(m % (unsigned int)g.W), h = (int)(m / (unsigned int)g.W % (unsigned int)g.H);
      const int image = (int)(m / ((unsigned int)g.W * (unsigned int)g.H));
      top[i] = m < M ? h + g.padding_h : outside;
      left[i] = w + g.padding_w;
      image_base[i] = (cg_i64)image * g.OH * g.OW * g.O;
    }
  }

  // Issues the cp.async of k-tile kt into the stage's tile at shared address `dst`.
  CG_DEVICE void copy(unsigned int dst, cg_i64 kt) const {
    const unsigned int k = k_first + (unsigned int)kt * BK, OG = (unsigned int)(g.O / g.groups);
    const int o = (int)(k % OG), tap = (int)(k / OG);
    const int dh = (tap / g.KW) * g.dilation_h, dw = (tap % g.KW) * g.dilation_w;
    const bool k_inside = k < k_end;  // (OG whole chunks: a chunk is wholly inside or past K)
    CG_UNROLL
    for (int i = 0; i < per_thread; ++i) {
      const int th = top[i] - dh, tw = left[i] - dw;
      const int oh = th / g.stride_h, ow = tw / g.stride_w;
      const bool inside = k_inside && th >= 0 && tw >= 0 && th % g.stride_h == 0 && tw % g.stride_w == 0 &&
                          oh < g.OH && ow < g.OW;
      cg_cp_async_16_at(dst + (unsigned int)(layout::offset(smem_offset, i) * (int)sizeof(T)),
                        inside ? dout + image_base[i] + ((cg_i64)oh * g.OW + ow) * g.O + o : dout, inside ? 16 : 0);
    }
  }
};

// A strided data gradient split by the stride (dilation 1): the pixels of
// dx whose (h + padding_h) % stride_h is rh take exactly the taps i = rh,
// rh + stride_h, ..., each from output row oh = (h + padding_h - i) /
// stride_h, with no remainder to test (and so for w). Class (rh, rw), index
// rh * stride_w + rw, is a dense GEMM of its own: M = B * rows * cols (its
// pixels, (image, qh, qw) with h = h0 + qh * stride_h), K = tap_rows *
// tap_cols * OG (k = (ti, tj, o), tap (rh + ti * stride_h, rw + tj *
// stride_w)), N = CG; a class no tap reaches (a 1 x 1 convolution's odd
// pixels at stride 2) has K = 0, and its dx is zeros. Its output row m is
// dx's pixel row(m). Sizes in 32 bits, as the gathers' below.
struct cg_conv2d_dgrad_class {
  int rh, rw;              // the residues
  int h0, w0;              // the class's first pixel row and column
  int rows, cols;          // its pixel rows and columns
  int tap_rows, tap_cols;  // the taps that reach it
  int oh0, ow0;            // the output pixel of its first pixel's first tap
  unsigned int M, K;
  // ceil(2^32 / tap_cols): a tap's row is (tap * tap_col_magic) >> 32, exact
  // for any tap under 2^32 / tap_cols, as a multiply where a division by a
  // value known only at run time would take about twenty instructions.
  unsigned long long tap_col_magic;

  CG_DEVICE cg_conv2d_dgrad_class(const cg_conv2d_geometry& g, int images, int index) {
    rh = index / g.stride_w, rw = index % g.stride_w;
    h0 = ((rh - g.padding_h) % g.stride_h + g.stride_h) % g.stride_h;
    w0 = ((rw - g.padding_w) % g.stride_w + g.stride_w) % g.stride_w;
    rows = h0 < g.H ? (g.H - h0 + g.stride_h - 1) / g.stride_h : 0;
    cols = w0 < g.W ? (g.W - w0 + g.stride_w - 1) / g.stride_w : 0;
    tap_rows = rh < g.KH ? (g.KH - rh + g.stride_h - 1) / g.stride_h : 0;
    tap_cols = rw < g.KW ? (g.KW - rw + g.stride_w - 1) / g.stride_w : 0;
    oh0 = (h0 + g.padding_h - rh) / g.stride_h;  // exact: h0 + padding_h = rh (mod stride_h)
    ow0 = (w0 + g.padding_w - rw) / g.stride_w;
    M = (unsigned int)images * rows * cols;
    K = (unsigned int)(tap_rows * tap_cols) * (unsigned int)(g.O / g.groups);
    tap_col_magic = tap_cols > 0 ? ((1ull << 32) + (unsigned int)tap_cols - 1) / (unsigned int)tap_cols : 0;
  }

  // The tap row of a class tap (tap / tap_cols).
  CG_DEVICE static int tap_row(int tap, unsigned long long magic) {
    return (int)(((unsigned long long)(unsigned int)tap * magic) >> 32);
  }

  // Row m's image and place (qh, qw) among the class's pixels.
  CG_DEVICE void place(unsigned int m, int* image, int* qh, int* qw) const {
    const unsigned int rest = m / (unsigned int)cols;
    *qw = (int)(m % (unsigned int)cols), *qh = (int)(rest % (unsigned int)rows), *image = (int)(rest / (unsigned int)rows);
  }

  // dx's pixel (image, h, w), as image * H * W + h * W + w, of row m.
  CG_DEVICE cg_i64 row(const cg_conv2d_geometry& g, cg_i64 m) const {
    int image, qh, qw;
    place((unsigned int)m, &image, &qh, &qw);
    return ((cg_i64)image * g.H + h0 + qh * g.stride_h) * g.W + w0 + qw * g.stride_w;
  }
};

// dx's A copier for a class of a strided data gradient: for each of a
// thread's rows, dout at output pixel (oh0 + qh - ti, ow0 + qw - tj) for the
// k-tile's k = (ti, tj, o), or zeros where that lies outside the output. As
// cg_conv2d_nhwc_dout_taps, each row decoded once a tile; a k-tile costs a
// thread the division of k into (tap, channel) and, a chunk, the bounds
// compares: no divisibility test, no tap that does not divide.
template <int BM, int BK, typename T, int THREADS>
struct cg_conv2d_nhwc_dout_class_taps {
  typedef cg_gemm_operand<BM, BK, true, T> operand;
  typedef typename operand::template copy_layout<THREADS> layout;
  static constexpr int per_thread = layout::per_thread, row_stride = layout::row_stride;
  static constexpr int outside = -(1 << 30);  // a row past M: every chunk of it is zeros
  const T* dout;
  cg_conv2d_geometry g;
  int tap_cols;
  unsigned long long tap_col_magic;
  cg_i64 image_base[per_thread];          // offset of each row's image's first dout pixel
  int top[per_thread], left[per_thread];  // each row's output pixel at tap (0, 0)
  unsigned int k_first, k_end;
  int smem_offset;

  CG_DEVICE cg_conv2d_nhwc_dout_class_taps(const T* dout_group, const cg_conv2d_geometry& geometry,
                                           const cg_conv2d_dgrad_class& c, cg_i64 m0, cg_i64 k_begin, cg_i64 k_end_)
      : dout(dout_group), g(geometry), tap_cols(c.tap_cols), tap_col_magic(c.tap_col_magic),
        k_end((unsigned int)k_end_) {
    const int row = layout::row(), col = layout::col();
    k_first = (unsigned int)k_begin + col;
    smem_offset = operand::tile::offset(row, col);
    CG_UNROLL
    for (int i = 0; i < per_thread; ++i) {
      const unsigned int m = (unsigned int)(m0 + row + i * row_stride);
      int image, qh, qw;
      c.place(m, &image, &qh, &qw);
      top[i] = m < c.M ? c.oh0 + qh : outside;
      left[i] = c.ow0 + qw;
      image_base[i] = (cg_i64)image * g.OH * g.OW * g.O;
    }
  }

  // Issues the cp.async of k-tile kt into the stage's tile at shared address `dst`.
  CG_DEVICE void copy(unsigned int dst, cg_i64 kt) const {
    const unsigned int k = k_first + (unsigned int)kt * BK, OG = (unsigned int)(g.O / g.groups);
    const int o = (int)(k % OG), tap = (int)(k / OG);
    const int ti = cg_conv2d_dgrad_class::tap_row(tap, tap_col_magic), tj = tap - ti * tap_cols;
    const bool k_inside = k < k_end;  // (OG whole chunks: a chunk is wholly inside or past K)
    CG_UNROLL
    for (int i = 0; i < per_thread; ++i) {
      const int oh = top[i] - ti, ow = left[i] - tj;
      const bool inside = k_inside && oh >= 0 && ow >= 0 && oh < g.OH && ow < g.OW;
      cg_cp_async_16_at(dst + (unsigned int)(layout::offset(smem_offset, i) * (int)sizeof(T)),
                        inside ? dout + image_base[i] + ((cg_i64)oh * g.OW + ow) * g.O + o : dout, inside ? 16 : 0);
    }
  }
};

// The B of a class of a strided data gradient: the weight of output channel
// o at tap (rh + ti * stride_h, rw + tj * stride_w) of k = (ti, tj, o),
// input channels n on.
template <typename T>
struct cg_conv2d_nhwc_weight_class_taps {
  const T* weight;  // the group's first output channel
  cg_conv2d_geometry g;
  int rh, rw, tap_cols;
  unsigned long long tap_col_magic;
  CG_DEVICE const T* at(cg_i64 n, cg_i64 k64) const {
    const unsigned int k = (unsigned int)k64, OG = (unsigned int)(g.O / g.groups);
    const int o = (int)(k % OG), tap = (int)(k / OG), ti = cg_conv2d_dgrad_class::tap_row(tap, tap_col_magic);
    const int i = rh + ti * g.stride_h, j = rw + (tap - ti * tap_cols) * g.stride_w;
    return weight + (((cg_i64)o * g.KH + i) * g.KW + j) * (g.C / g.groups) + n;
  }
};

// dx's B: the weight of output channel o at tap (i, j) of k = (i, j, o),
// input channels n on.
template <typename T>
struct cg_conv2d_nhwc_weight_taps {
  const T* weight;  // the group's first output channel
  cg_conv2d_geometry g;
  CG_DEVICE const T* at(cg_i64 n, cg_i64 k64) const {
    const unsigned int k = (unsigned int)k64, OG = (unsigned int)(g.O / g.groups);
    const int o = (int)(k % OG), tap = (int)(k / OG);
    return weight + ((cg_i64)o * g.KH * g.KW + tap) * (g.C / g.groups) + n;
  }
};

// dweight's B: the input pixel that tap (i, j) of n = (i, j, c) reads for
// output pixel k, channels c on, or zeros where it lies outside the image.
template <typename T>
struct cg_conv2d_nhwc_pixel_taps {
  const T* x;  // the group's first input channel of the first pixel
  cg_conv2d_geometry g;
  CG_DEVICE const T* at(cg_i64 n64, cg_i64 k64) const {
    const unsigned int n = (unsigned int)n64, k = (unsigned int)k64, CG = (unsigned int)(g.C / g.groups);
    const int c = (int)(n % CG), tap = (int)(n / CG);
    const int ow = (int)(k % (unsigned int)g.OW), oh = (int)(k / (unsigned int)g.OW % (unsigned int)g.OH);
    const int image = (int)(k / ((unsigned int)g.OW * (unsigned int)g.OH));
    const int h = oh * g.stride_h - g.padding_h + (tap / g.KW) * g.dilation_h;
    const int w = ow * g.stride_w - g.padding_w + (tap % g.KW) * g.dilation_w;
    if ((unsigned)h >= (unsigned)g.H || (unsigned)w >= (unsigned)g.W) return nullptr;
    return x + (((cg_i64)image * g.H + h) * g.W + w) * g.C + c;
  }
};

// The tile (tile_m, tile_n) of one group's dx GEMM over k in [k_begin,
// k_end), into acc, on the pipelined mainloop. M = B * H * W, N = CG.
template <typename Config, typename T>
CG_DEVICE void cg_conv2d_nhwc_backward_data_mainloop(cg_gemm_accumulators<Config>& acc, const T* dout_group,
                                                     const T* w_group, const cg_conv2d_geometry& g, cg_i64 M,
                                                     cg_i64 N, cg_i64 k_begin, cg_i64 k_end, cg_i64 tile_m,
                                                     cg_i64 tile_n, T* smem) {
  const cg_conv2d_nhwc_dout_taps<Config::BM, Config::BK, T, Config::THREADS> copy_a(dout_group, g, M,
                                                                                     tile_m * Config::BM, k_begin, k_end);
  const cg_gemm_gather<Config::BN, Config::BK, false, T, Config::THREADS, cg_conv2d_nhwc_weight_taps<T>> copy_b(
      cg_conv2d_nhwc_weight_taps<T>{w_group, g}, w_group, tile_n * Config::BN, N, k_begin, k_end);
  cg_gemm_mainloop_with<Config, T, true, false>(acc, copy_a, copy_b, (k_end - k_begin + Config::BK - 1) / Config::BK,
                                                 smem);
}

// The tile (tile_m, tile_n) of class c's GEMM of one group's strided data
// gradient, over k in [k_begin, k_end) cut to the class's K (none where no
// tap reaches it), into acc, on the pipelined mainloop. N = CG.
template <typename Config, typename T>
CG_DEVICE void cg_conv2d_nhwc_backward_data_class_mainloop(cg_gemm_accumulators<Config>& acc, const T* dout_group,
                                                           const T* w_group, const cg_conv2d_geometry& g,
                                                           const cg_conv2d_dgrad_class& c, cg_i64 N, cg_i64 k_begin,
                                                           cg_i64 k_end, cg_i64 tile_m, cg_i64 tile_n, T* smem) {
  if (k_end > (cg_i64)c.K) k_end = c.K;
  const cg_i64 k_tiles = k_end > k_begin ? (k_end - k_begin + Config::BK - 1) / Config::BK : 0;
  const cg_conv2d_nhwc_dout_class_taps<Config::BM, Config::BK, T, Config::THREADS> copy_a(
      dout_group, g, c, tile_m * Config::BM, k_begin, k_end);
  const cg_gemm_gather<Config::BN, Config::BK, false, T, Config::THREADS, cg_conv2d_nhwc_weight_class_taps<T>> copy_b(
      cg_conv2d_nhwc_weight_class_taps<T>{w_group, g, c.rh, c.rw, c.tap_cols, c.tap_col_magic}, w_group, tile_n * Config::BN, N,
      k_begin, k_end);
  cg_gemm_mainloop_with<Config, T, true, false>(acc, copy_a, copy_b, k_tiles, smem);
}

// The tile (tile_m, tile_n) of one group's dweight GEMM over k in
// [k_begin, k_end), into acc, on the pipelined mainloop. M = OG, N = KH * KW
// * CG.
template <typename Config, typename T>
CG_DEVICE void cg_conv2d_nhwc_backward_weight_mainloop(cg_gemm_accumulators<Config>& acc, const T* dout_group,
                                                       const T* x_group, const cg_conv2d_geometry& g, cg_i64 M,
                                                       cg_i64 N, cg_i64 k_begin, cg_i64 k_end, cg_i64 tile_m,
                                                       cg_i64 tile_n, T* smem) {
  const typename cg_gemm_operand<Config::BM, Config::BK, false, T>::template copier<Config::THREADS> copy_a(
      dout_group, g.O, tile_m * Config::BM, M, k_begin, k_end);
  const cg_gemm_gather<Config::BN, Config::BK, false, T, Config::THREADS, cg_conv2d_nhwc_pixel_taps<T>> copy_b(
      cg_conv2d_nhwc_pixel_taps<T>{x_group, g}, x_group, tile_n * Config::BN, N, k_begin, k_end);
  cg_gemm_mainloop_with<Config, T, false, false>(acc, copy_a, copy_b, (k_end - k_begin + Config::BK - 1) / Config::BK,
                                                  smem);
}

// The direct forms, one gradient element a call, where the mainloop does not
// run (f32 without TF32, channels not whole 16 bytes, a megakernel):
// dx at pixel (h, w) for the input channel whose weights load_w(o, tap)
// reads, load_dout(oh, ow, o) reading the image's dout in the group.
template <typename LoadW, typename LoadDout>
CG_OP("conv2d_nhwc_backward_data",
      "pattern: opaque",
      "forward: conv2d_nhwc",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: stride_h int = 1",
      "arg: stride_w int = 1",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: dilation_h int = 1",
      "arg: dilation_w int = 1",
      "arg: groups int = 1",
      "shape: x:[B, H, W, groups * CG] weight:[O, KH, KW, CG] dout:[B, (H + 2 * padding_h - dilation_h * (KH - 1) - 1) / stride_h + 1, (W + 2 * padding_w - dilation_w * (KW - 1) - 1) / stride_w + 1, O] -> dx:[B, H, W, groups * CG]",
      "variant: cg_conv2d_nhwc_backward_data_mainloop",
      "variant: cg_conv2d_nhwc_backward_data_class_mainloop",
      "variant: cg_gemm_config",
      "variant: cg_gemm_each_coalesced",
      "variant: cg_gemm_each_coalesced_vector",
      "variant: cg_gemm_split_k",
      "flops: 2 * numel(dout) * CG * KH * KW",
      "doc: the gradient of conv2d_nhwc with respect to x (reads x for its shape only): a transposed convolution as an implicit GEMM, on the tensor-core mainloop where both channel counts a group are whole 16 bytes, split by a stride over 1 (dilation 1) into a dense GEMM a class of pixels; deterministic")
CG_DEVICE float cg_conv2d_nhwc_backward_data_direct(LoadW load_w, LoadDout load_dout, cg_conv2d_geometry g, int h,
                                                    int w) {
  float acc = 0.0f;
  const int OG = g.O / g.groups;
  for (int i = 0; i < g.KH; ++i) {
    const int th = h + g.padding_h - i * g.dilation_h;
    if (th < 0 || th % g.stride_h != 0 || th / g.stride_h >= g.OH) continue;
    for (int j = 0; j < g.KW; ++j) {
      const int tw = w + g.padding_w - j * g.dilation_w;
      if (tw < 0 || tw % g.stride_w != 0 || tw / g.stride_w >= g.OW) continue;
      for (int o = 0; o < OG; ++o) acc += load_w(o, i * g.KW + j) * load_dout(th / g.stride_h, tw / g.stride_w, o);
    }
  }
  return acc;
}

// dweight at tap (i, j) for the output and input channel that
// load_dout(image, oh, ow) and load_x(image, h, w) read, over `images` images.
template <typename LoadDout, typename LoadX>
CG_OP("conv2d_nhwc_backward_weight",
      "pattern: opaque",
      "forward: conv2d_nhwc",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: dout input T",
      "tensor: dweight output T",
      "arg: stride_h int = 1",
      "arg: stride_w int = 1",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: dilation_h int = 1",
      "arg: dilation_w int = 1",
      "arg: groups int = 1",
      "shape: x:[B, H, W, groups * CG] weight:[O, KH, KW, CG] dout:[B, (H + 2 * padding_h - dilation_h * (KH - 1) - 1) / stride_h + 1, (W + 2 * padding_w - dilation_w * (KW - 1) - 1) / stride_w + 1, O] -> dweight:[O, KH, KW, CG]",
      "variant: cg_conv2d_nhwc_backward_weight_mainloop",
      "variant: cg_gemm_config",
      "variant: cg_gemm_each_coalesced",
      "variant: cg_gemm_each_coalesced_vector",
      "variant: cg_gemm_split_k",
      "flops: 2 * numel(dout) * CG * KH * KW",
      "doc: the gradient of conv2d_nhwc with respect to its weight (reads the weight for its shape only): an implicit GEMM over every image's pixels, on the tensor-core mainloop where both channel counts a group are whole 16 bytes, split over k where its tiles are few; deterministic")
CG_DEVICE float cg_conv2d_nhwc_backward_weight_direct(LoadDout load_dout, LoadX load_x, cg_conv2d_geometry g,
                                                      int images, int i, int j) {
  float acc = 0.0f;
  for (int b = 0; b < images; ++b)
    for (int oh = 0; oh < g.OH; ++oh) {
      const int h = oh * g.stride_h - g.padding_h + i * g.dilation_h;
      if (h < 0 || h >= g.H) continue;
      for (int ow = 0; ow < g.OW; ++ow) {
        const int w = ow * g.stride_w - g.padding_w + j * g.dilation_w;
        if (w >= 0 && w < g.W) acc += load_dout(b, oh, ow) * load_x(b, h, w);
      }
    }
  return acc;
}

// conv2d's gradients, which the derive pass links to it: one kernel whose
// blocks fall in up to three ranges, one a gradient asked for (the emitter
// lays them out):
//  - dx, the data gradient, for each image and group an implicit GEMM
//      dx[c, q] = sum over k of weight[o, c, i, j] * dout_at(k, q),
//    M = CG, N = H * W, K = OG * KH * KW, k = (o, i, j), q = (h, w), where
//    dout_at(k, q) is dout[o, oh, ow] for the output position whose window
//    puts tap (i, j) on (h, w): oh = (h + padding_h - i * dilation_h) /
//    stride_h when that divides exactly and lies in the output, else 0;
//  - dweight, for each group an implicit GEMM over every image's positions,
//      dweight[o, k] = sum over (b, p) of dout[b, o, p] * patch_b(k, p),
//    M = OG, N = CG * KH * KW, K = B * OH * OW (patch as in conv2d);
//  - dbias[o], dout summed over images and positions, a block a channel.
// Each sum runs in a fixed order (the tile's k loop, a thread's own loop, the
// block's tree): the same bits every run. Hooks: load_w(m, k) as conv2d's,
// load_dout(b, o, oh, ow) and load_x(b, c, h, w) within the group, and
// epilogue(m, n, acc).
template <int BM, int BN, int BK, typename LoadW, typename LoadDout, typename Epilogue>
CG_OP("conv2d_backward",
      "pattern: opaque",
      "forward: conv2d",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: weight weight T",
      "tensor: dout input T",
      "tensor: dx output T optional",
      "tensor: dweight output T optional",
      "tensor: dbias output T optional",
      "arg: stride_h int = 1",
      "arg: stride_w int = 1",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: dilation_h int = 1",
      "arg: dilation_w int = 1",
      "arg: groups int = 1",
      "shape: x:[B, groups * CG, H, W] weight:[O, CG, KH, KW] dout:[B, O, (H + 2 * padding_h - dilation_h * (KH - 1) - 1) / stride_h + 1, (W + 2 * padding_w - dilation_w * (KW - 1) - 1) / stride_w + 1] -> dx:[B, groups * CG, H, W] dweight:[O, CG, KH, KW] dbias:[O]",
      "smem: 4 * (BM * (BK + 1) + BK * (BN + 1))",
      "variant: cg_conv2d_backward_weight_tile",
      "variant: cg_conv2d_backward_data_direct",
      "variant: cg_conv2d_backward_weight_direct",
      "variant: cg_conv2d_backward_bias",
      "doc: gradients of conv2d with respect to x, weight and bias (each where asked for), as implicit GEMMs on the matmul tile; deterministic")
CG_DEVICE void cg_conv2d_backward_data_tile(LoadW load_w, LoadDout load_dout, Epilogue epilogue, cg_conv2d_geometry g,
                                            int image, int tile_m, int tile_n, float* smem) {
  const int kernel_area = g.KH * g.KW, CG = g.C / g.groups;
  cg_matmul_tile<BM, BN, BK>(
      [&](int c, int k) { return load_w(k / kernel_area, c * kernel_area + k % kernel_area); },
      [&](int k, int q) {
        const int o = k / kernel_area, r = k % kernel_area;
        const int th = q / g.W + g.padding_h - (r / g.KW) * g.dilation_h;
        const int tw = q % g.W + g.padding_w - (r % g.KW) * g.dilation_w;
        if (th < 0 || tw < 0 || th % g.stride_h != 0 || tw % g.stride_w != 0) return 0.0f;
        const int oh = th / g.stride_h, ow = tw / g.stride_w;
        return oh < g.OH && ow < g.OW ? load_dout(image, o, oh, ow) : 0.0f;
      },
      epilogue, CG, g.H * g.W, g.O / g.groups * kernel_area, tile_m, tile_n, smem);
}

// dweight as an implicit GEMM for one group (above); `images` is B.
template <int BM, int BN, int BK, typename LoadDout, typename LoadX, typename Epilogue>
CG_DEVICE void cg_conv2d_backward_weight_tile(LoadDout load_dout, LoadX load_x, Epilogue epilogue, cg_conv2d_geometry g,
                                              int images, int tile_m, int tile_n, float* smem) {
  const int kernel_area = g.KH * g.KW, positions = g.OH * g.OW;
  cg_matmul_tile<BM, BN, BK>(
      [&](int o, int k) { return load_dout(k / positions, o, k % positions / g.OW, k % g.OW); },
      [&](int k, int n) {
        const int b = k / positions, p = k % positions, c = n / kernel_area, r = n % kernel_area;
        const int h = p / g.OW * g.stride_h - g.padding_h + (r / g.KW) * g.dilation_h;
        const int w = p % g.OW * g.stride_w - g.padding_w + (r % g.KW) * g.dilation_w;
        return h >= 0 && h < g.H && w >= 0 && w < g.W ? load_x(b, c, h, w) : 0.0f;
      },
      epilogue, g.O / g.groups, g.C / g.groups * kernel_area, images * positions, tile_m, tile_n, smem);
}

// The direct forms, one gradient element a call, for GEMMs too thin for a
// tile (depthwise): dx at input channel c of the group, position (h, w);
// dweight at (o, c, i, j) of the group, over `images` images.
template <typename LoadW, typename LoadDout>
CG_DEVICE float cg_conv2d_backward_data_direct(LoadW load_w, LoadDout load_dout, cg_conv2d_geometry g, int image, int c,
                                               int h, int w) {
  float acc = 0.0f;
  const int OG = g.O / g.groups, kernel_area = g.KH * g.KW;
  for (int o = 0; o < OG; ++o)
    for (int i = 0; i < g.KH; ++i) {
      const int th = h + g.padding_h - i * g.dilation_h;
      if (th < 0 || th % g.stride_h != 0 || th / g.stride_h >= g.OH) continue;
      for (int j = 0; j < g.KW; ++j) {
        const int tw = w + g.padding_w - j * g.dilation_w;
        if (tw < 0 || tw % g.stride_w != 0 || tw / g.stride_w >= g.OW) continue;
        acc += load_w(o, c * kernel_area + i * g.KW + j) * load_dout(image, o, th / g.stride_h, tw / g.stride_w);
      }
    }
  return acc;
}
template <typename LoadDout, typename LoadX>
CG_DEVICE float cg_conv2d_backward_weight_direct(LoadDout load_dout, LoadX load_x, cg_conv2d_geometry g, int images,
                                                 int o, int c, int i, int j) {
  float acc = 0.0f;
  for (int b = 0; b < images; ++b)
    for (int oh = 0; oh < g.OH; ++oh) {
      const int h = oh * g.stride_h - g.padding_h + i * g.dilation_h;
      if (h < 0 || h >= g.H) continue;
      for (int ow = 0; ow < g.OW; ++ow) {
        const int w = ow * g.stride_w - g.padding_w + j * g.dilation_w;
        if (w >= 0 && w < g.W) acc += load_dout(b, o, oh, ow) * load_x(b, c, h, w);
      }
    }
  return acc;
}

// dbias[o]: every thread of the block sums its share of dout[b, o, :] in
// order, then the block's tree. `scratch` holds 32 floats of shared memory.
template <typename LoadDout>
CG_DEVICE float cg_conv2d_backward_bias(LoadDout load_dout, cg_conv2d_geometry g, int images, int o, float* scratch) {
  const cg_i64 positions = (cg_i64)g.OH * g.OW;
  float partial = 0.0f;
  for (cg_i64 e = threadIdx.x; e < images * positions; e += blockDim.x)
    partial += load_dout((int)(e / positions), o, (int)(e % positions / g.OW), (int)(e % g.OW));
  return cg_block_sum(partial, scratch);
}

// The window of one 2-D pooling, as the emitter writes it into the kernel.
struct cg_pool2d_window {
  int H, W, OH, OW;
  int KH, KW, stride_h, stride_w, padding_h, padding_w, dilation_h, dilation_w;
};

// The largest x in window (oh, ow) of the image at `base`, whose pixel (h, w)
// is element base + (h * W + w) * pixel: one plane of NCHW (pixel 1), one
// channel of NHWC (pixel C).
template <typename T>
CG_DEVICE float cg_max_pool2d_window(const T* x, cg_i64 base, cg_i64 pixel, int oh, int ow, const cg_pool2d_window& p) {
  float best = cg_neg_inf();
  for (int a = 0; a < p.KH; ++a) {
    const int h = oh * p.stride_h - p.padding_h + a * p.dilation_h;
    if (h < 0 || h >= p.H) continue;
    for (int b = 0; b < p.KW; ++b) {
      const int w = ow * p.stride_w - p.padding_w + b * p.dilation_w;
      if (w < 0 || w >= p.W) continue;
      const float v = cg_widen(cg_load(x, base + ((cg_i64)h * p.W + w) * pixel));
      best = v > best || v != v ? v : best;  // a NaN wins and stays, as in PyTorch
    }
  }
  return best;
}

// Max pooling: element i of out[..., OH, OW] is the largest x in its window;
// padding never wins (as PyTorch pads with -inf).
template <typename T>
CG_OP("max_pool2d",
      "pattern: gather",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: out output T",
      "arg: kernel_h int",
      "arg: kernel_w int",
      "arg: stride_h int",
      "arg: stride_w int",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: dilation_h int = 1",
      "arg: dilation_w int = 1",
      "arg: ceil_mode bool = false",
      "shape: x:[...S, H, W] -> out:[...S, (H + 2 * padding_h - dilation_h * (kernel_h - 1) - 1 + (ceil_mode ? stride_h - 1 : 0)) / stride_h + 1, (W + 2 * padding_w - dilation_w * (kernel_w - 1) - 1 + (ceil_mode ? stride_w - 1 : 0)) / stride_w + 1]",
      "flops: numel(out) * kernel_h * kernel_w",
      "backward: max_pool2d_backward",
      "doc: torch.nn.functional.max_pool2d; ceil_mode rounds the output size up (a last window that overhangs the input takes what it covers)")
CG_DEVICE float cg_max_pool2d(const T* x, cg_i64 i, cg_pool2d_window p) {
  const int ow = (int)(i % p.OW), oh = (int)(i / p.OW % p.OH);
  return cg_max_pool2d_window(x, i / ((cg_i64)p.OW * p.OH) * p.H * p.W, 1, oh, ow, p);
}

// Max pooling on channels-last tensors: element i of out[B, OH, OW, C], so
// that a warp's lanes read consecutive channels of each pixel.
template <typename T>
CG_OP("max_pool2d_nhwc",
      "pattern: gather",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: out output T",
      "arg: kernel_h int",
      "arg: kernel_w int",
      "arg: stride_h int",
      "arg: stride_w int",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: dilation_h int = 1",
      "arg: dilation_w int = 1",
      "arg: ceil_mode bool = false",
      "shape: x:[B, H, W, C] -> out:[B, (H + 2 * padding_h - dilation_h * (kernel_h - 1) - 1 + (ceil_mode ? stride_h - 1 : 0)) / stride_h + 1, (W + 2 * padding_w - dilation_w * (kernel_w - 1) - 1 + (ceil_mode ? stride_w - 1 : 0)) / stride_w + 1, C]",
      "flops: numel(out) * kernel_h * kernel_w",
      "backward: max_pool2d_nhwc_backward",
      "doc: max_pool2d on channels-last tensors (x and out NHWC), as conv2d_nhwc's neighbour")
CG_DEVICE float cg_max_pool2d_nhwc(const T* x, cg_i64 i, cg_pool2d_window p, int C) {
  const cg_i64 pixel = i / C;
  const int ow = (int)(pixel % p.OW), oh = (int)(pixel / p.OW % p.OH);
  return cg_max_pool2d_window(x, pixel / ((cg_i64)p.OW * p.OH) * p.H * p.W * C + i % C, C, oh, ow, p);
}

// The divisor of avg_pool2d's window whose top-left corner is (h0, w0): the
// window clipped to the image, or with count_include_pad to the padded image
// (as PyTorch counts it).
CG_DEVICE int cg_avg_pool2d_divisor(int h0, int w0, const cg_pool2d_window& p, bool count_include_pad) {
  const int top = count_include_pad ? h0 : (h0 > 0 ? h0 : 0), left = count_include_pad ? w0 : (w0 > 0 ? w0 : 0);
  const int bottom_edge = count_include_pad ? p.H + p.padding_h : p.H, right_edge = count_include_pad ? p.W + p.padding_w : p.W;
  const int bottom = h0 + p.KH < bottom_edge ? h0 + p.KH : bottom_edge;
  const int right = w0 + p.KW < right_edge ? w0 + p.KW : right_edge;
  return bottom > top && right > left ? (bottom - top) * (right - left) : 0;  // 0: a window of padding alone
}

// The mean of x over window (oh, ow) of the image at `base`, pixels `pixel`
// apart (cg_max_pool2d_window's layout), over cg_avg_pool2d_divisor.
template <typename T>
CG_DEVICE float cg_avg_pool2d_window(const T* x, cg_i64 base, cg_i64 pixel, int oh, int ow, const cg_pool2d_window& p,
                                     bool count_include_pad) {
  const int h0 = oh * p.stride_h - p.padding_h, w0 = ow * p.stride_w - p.padding_w;
  float sum = 0.0f;
  for (int h = h0 > 0 ? h0 : 0; h < h0 + p.KH && h < p.H; ++h)
    for (int w = w0 > 0 ? w0 : 0; w < w0 + p.KW && w < p.W; ++w)
      sum += cg_widen(cg_load(x, base + ((cg_i64)h * p.W + w) * pixel));
  const int count = cg_avg_pool2d_divisor(h0, w0, p, count_include_pad);
  return count > 0 ? sum / (float)count : 0.0f;
}

// Average pooling over the window; count_include_pad counts the padding's
// zeros in the divisor (PyTorch's default).
template <typename T>
CG_OP("avg_pool2d",
      "pattern: gather",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: out output T",
      "arg: kernel_h int",
      "arg: kernel_w int",
      "arg: stride_h int",
      "arg: stride_w int",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: count_include_pad bool = true",
      "shape: x:[...S, H, W] -> out:[...S, (H + 2 * padding_h - kernel_h) / stride_h + 1, (W + 2 * padding_w - kernel_w) / stride_w + 1]",
      "flops: numel(out) * kernel_h * kernel_w",
      "backward: avg_pool2d_backward",
      "doc: torch.nn.functional.avg_pool2d (ceil_mode false, no divisor_override)")
CG_DEVICE float cg_avg_pool2d(const T* x, cg_i64 i, cg_pool2d_window p, bool count_include_pad) {
  const int ow = (int)(i % p.OW), oh = (int)(i / p.OW % p.OH);
  return cg_avg_pool2d_window(x, i / ((cg_i64)p.OW * p.OH) * p.H * p.W, 1, oh, ow, p, count_include_pad);
}

// Average pooling on channels-last tensors: element i of out[B, OH, OW, C],
// so that a warp's lanes read consecutive channels of each pixel.
template <typename T>
CG_OP("avg_pool2d_nhwc",
      "pattern: gather",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: out output T",
      "arg: kernel_h int",
      "arg: kernel_w int",
      "arg: stride_h int",
      "arg: stride_w int",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: count_include_pad bool = true",
      "shape: x:[B, H, W, C] -> out:[B, (H + 2 * padding_h - kernel_h) / stride_h + 1, (W + 2 * padding_w - kernel_w) / stride_w + 1, C]",
      "flops: numel(out) * kernel_h * kernel_w",
      "backward: avg_pool2d_nhwc_backward",
      "doc: avg_pool2d on channels-last tensors (x and out NHWC), as conv2d_nhwc's neighbour")
CG_DEVICE float cg_avg_pool2d_nhwc(const T* x, cg_i64 i, cg_pool2d_window p, bool count_include_pad, int C) {
  const cg_i64 pixel = i / C;
  const int ow = (int)(pixel % p.OW), oh = (int)(pixel / p.OW % p.OH);
  return cg_avg_pool2d_window(x, pixel / ((cg_i64)p.OW * p.OH) * p.H * p.W * C + i % C, C, oh, ow, p,
                              count_include_pad);
}

// The mean of window (oh, ow) of the image at `base`, pixels `pixel` apart
// (cg_max_pool2d_window's layout).
template <typename T>
CG_DEVICE float cg_adaptive_avg_pool2d_window(const T* x, cg_i64 base, cg_i64 pixel, int oh, int ow, int H, int W,
                                              int OH, int OW) {
  const int h0 = oh * H / OH, h1 = ((oh + 1) * H + OH - 1) / OH;
  const int w0 = ow * W / OW, w1 = ((ow + 1) * W + OW - 1) / OW;
  float sum = 0.0f;
  for (int h = h0; h < h1; ++h)
    for (int w = w0; w < w1; ++w) sum += cg_widen(cg_load(x, base + ((cg_i64)h * W + w) * pixel));
  return sum / (float)((h1 - h0) * (w1 - w0));
}

// Adaptive average pooling to the output's size: output row oh averages
// input rows floor(oh * H / OH) to ceil((oh + 1) * H / OH), and so for
// columns (as PyTorch's adaptive_avg_pool2d).
template <typename T>
CG_OP("adaptive_avg_pool2d",
      "pattern: gather",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[...S, H, W] -> out:[...S, OH, OW]",
      "flops: numel(x)",
      "backward: adaptive_avg_pool2d_backward",
      "doc: torch.nn.functional.adaptive_avg_pool2d to the output's declared size")
CG_DEVICE float cg_adaptive_avg_pool2d(const T* x, cg_i64 i, int H, int W, int OH, int OW) {
  const int ow = (int)(i % OW), oh = (int)(i / OW % OH);
  return cg_adaptive_avg_pool2d_window(x, i / ((cg_i64)OW * OH) * H * W, 1, oh, ow, H, W, OH, OW);
}

// Adaptive average pooling on channels-last tensors: element i of out[B, OH,
// OW, C]. To 1 x 1 (a classifier's head), out is [B, 1, 1, C]: flattened,
// the same [B, C] as NCHW's.
template <typename T>
CG_OP("adaptive_avg_pool2d_nhwc",
      "pattern: gather",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: out output T",
      "shape: x:[B, H, W, C] -> out:[B, OH, OW, C]",
      "flops: numel(x)",
      "backward: adaptive_avg_pool2d_nhwc_backward",
      "doc: adaptive_avg_pool2d on channels-last tensors (x and out NHWC) to the output's declared size")
CG_DEVICE float cg_adaptive_avg_pool2d_nhwc(const T* x, cg_i64 i, int H, int W, int OH, int OW, int C) {
  const cg_i64 pixel = i / C;
  const int ow = (int)(pixel % OW), oh = (int)(pixel / OW % OH);
  return cg_adaptive_avg_pool2d_window(x, pixel / ((cg_i64)OW * OH) * H * W * C + i % C, C, oh, ow, H, W, OH, OW);
}

// The pooling gradients, one element of dx a call (a gather: no atomics,
// the same bits every run): the dout of every window that covers it, in
// window order. Window (oh, ow) covers input row h through tap
// a = (h + padding_h - oh * stride_h) / dilation_h, so the windows that
// reach h are those oh with h + padding_h - a * dilation_h = oh * stride_h
// for some tap a.

// The input element max pooling's window (oh, ow) of the image at `base`
// chose, as its pixel's index in the image (h * W + w): the first largest, a
// NaN the last (cg_max_pool2d's order); -1 for a window of padding alone.
// Pixels are `pixel` elements apart (cg_max_pool2d_window's layout).
template <typename T>
CG_DEVICE int cg_max_pool2d_choice(const T* x, cg_i64 base, cg_i64 pixel, int oh, int ow, const cg_pool2d_window& p) {
  float best = cg_neg_inf();
  int choice = -1;
  for (int a = 0; a < p.KH; ++a) {
    const int h = oh * p.stride_h - p.padding_h + a * p.dilation_h;
    if (h < 0 || h >= p.H) continue;
    for (int b = 0; b < p.KW; ++b) {
      const int w = ow * p.stride_w - p.padding_w + b * p.dilation_w;
      if (w < 0 || w >= p.W) continue;
      const float v = cg_widen(cg_load(x, base + ((cg_i64)h * p.W + w) * pixel));
      if (v > best || v != v || choice < 0) {
        best = v;
        choice = h * p.W + w;
      }
    }
  }
  return choice;
}

// dx at pixel (h, w) of the image whose x is at x_base and whose windows'
// douts are at out_base, pixels `pixel` elements apart (1: NCHW, C: NHWC):
// the dout of each window that covers it and chose it.
template <typename T>
CG_DEVICE float cg_max_pool2d_backward_pixel(const T* x, const T* dout, cg_i64 x_base, cg_i64 out_base, cg_i64 pixel,
                                             int h, int w, const cg_pool2d_window& p) {
  float sum = 0.0f;
  for (int a = 0; a < p.KH; ++a) {
    const int th = h + p.padding_h - a * p.dilation_h;
    if (th < 0 || th % p.stride_h != 0 || th / p.stride_h >= p.OH) continue;
    for (int b = 0; b < p.KW; ++b) {
      const int tw = w + p.padding_w - b * p.dilation_w;
      if (tw < 0 || tw % p.stride_w != 0 || tw / p.stride_w >= p.OW) continue;
      const int oh = th / p.stride_h, ow = tw / p.stride_w;
      if (cg_max_pool2d_choice(x, x_base, pixel, oh, ow, p) == h * p.W + w)
        sum += cg_widen(cg_load(dout, out_base + ((cg_i64)oh * p.OW + ow) * pixel));
    }
  }
  return sum;
}

// dx[i]: the dout of each window whose choice is element i.
template <typename T>
CG_OP("max_pool2d_backward",
      "pattern: gather",
      "forward: max_pool2d",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: kernel_h int",
      "arg: kernel_w int",
      "arg: stride_h int",
      "arg: stride_w int",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: dilation_h int = 1",
      "arg: dilation_w int = 1",
      "arg: ceil_mode bool = false",
      "shape: x:[...S, H, W] dout:[...S, (H + 2 * padding_h - dilation_h * (kernel_h - 1) - 1 + (ceil_mode ? stride_h - 1 : 0)) / stride_h + 1, (W + 2 * padding_w - dilation_w * (kernel_w - 1) - 1 + (ceil_mode ? stride_w - 1 : 0)) / stride_w + 1] -> dx:[...S, H, W]",
      "variant: cg_max_pool2d_choice",
      "doc: gradient of max_pool2d: each window's dout goes to the element it chose (the first largest, as PyTorch)")
CG_DEVICE float cg_max_pool2d_backward(const T* x, const T* dout, cg_i64 i, cg_pool2d_window p) {
  const int w = (int)(i % p.W), h = (int)(i / p.W % p.H);
  const cg_i64 index = i / ((cg_i64)p.W * p.H);
  return cg_max_pool2d_backward_pixel(x, dout, index * p.H * p.W, index * p.OH * p.OW, 1, h, w, p);
}

// dx[i] of channels-last tensors (x, dout and dx NHWC): element i of
// dx[B, H, W, C], so that a warp's lanes gather consecutive channels.
template <typename T>
CG_OP("max_pool2d_nhwc_backward",
      "pattern: gather",
      "forward: max_pool2d_nhwc",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: kernel_h int",
      "arg: kernel_w int",
      "arg: stride_h int",
      "arg: stride_w int",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: dilation_h int = 1",
      "arg: dilation_w int = 1",
      "arg: ceil_mode bool = false",
      "shape: x:[B, H, W, C] dout:[B, (H + 2 * padding_h - dilation_h * (kernel_h - 1) - 1 + (ceil_mode ? stride_h - 1 : 0)) / stride_h + 1, (W + 2 * padding_w - dilation_w * (kernel_w - 1) - 1 + (ceil_mode ? stride_w - 1 : 0)) / stride_w + 1, C] -> dx:[B, H, W, C]",
      "variant: cg_max_pool2d_choice",
      "doc: gradient of max_pool2d_nhwc: each window's dout goes to the element it chose (the first largest, as PyTorch)")
CG_DEVICE float cg_max_pool2d_nhwc_backward(const T* x, const T* dout, cg_i64 i, cg_pool2d_window p, int C) {
  const cg_i64 pixel = i / C;
  const int w = (int)(pixel % p.W), h = (int)(pixel / p.W % p.H);
  const cg_i64 image = pixel / ((cg_i64)p.W * p.H), channel = i % C;
  return cg_max_pool2d_backward_pixel(x, dout, image * p.H * p.W * C + channel, image * p.OH * p.OW * C + channel, C, h,
                                      w, p);
}

// dx at pixel (h, w) of an image whose douts are at out_base, pixels `pixel`
// elements apart: each covering window's dout over its divisor (as
// cg_avg_pool2d_window divides).
template <typename T>
CG_DEVICE float cg_avg_pool2d_backward_pixel(const T* dout, cg_i64 out_base, cg_i64 pixel, int h, int w,
                                             const cg_pool2d_window& p, bool count_include_pad) {
  float sum = 0.0f;
  for (int a = 0; a < p.KH; ++a) {
    const int th = h + p.padding_h - a;
    if (th < 0 || th % p.stride_h != 0 || th / p.stride_h >= p.OH) continue;
    const int oh = th / p.stride_h;
    for (int b = 0; b < p.KW; ++b) {
      const int tw = w + p.padding_w - b;
      if (tw < 0 || tw % p.stride_w != 0 || tw / p.stride_w >= p.OW) continue;
      const int ow = tw / p.stride_w;
      const int count = cg_avg_pool2d_divisor(oh * p.stride_h - p.padding_h, ow * p.stride_w - p.padding_w, p,
                                              count_include_pad);
      sum += cg_widen(cg_load(dout, out_base + ((cg_i64)oh * p.OW + ow) * pixel)) / (float)count;
    }
  }
  return sum;
}

// dx[i]: each covering window's dout over the window's divisor (as
// cg_avg_pool2d counts it).
template <typename T>
CG_OP("avg_pool2d_backward",
      "pattern: gather",
      "forward: avg_pool2d",
      "types: T = f32 f16 bf16",
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: kernel_h int",
      "arg: kernel_w int",
      "arg: stride_h int",
      "arg: stride_w int",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: count_include_pad bool = true",
      "shape: dout:[...S, (H + 2 * padding_h - kernel_h) / stride_h + 1, (W + 2 * padding_w - kernel_w) / stride_w + 1] -> dx:[...S, H, W]",
      "doc: gradient of avg_pool2d: each window's dout spread evenly over what it averaged")
CG_DEVICE float cg_avg_pool2d_backward(const T* dout, cg_i64 i, cg_pool2d_window p, bool count_include_pad) {
  const int w = (int)(i % p.W), h = (int)(i / p.W % p.H);
  return cg_avg_pool2d_backward_pixel(dout, i / ((cg_i64)p.W * p.H) * p.OH * p.OW, 1, h, w, p, count_include_pad);
}

// dx[i] of channels-last tensors (dout and dx NHWC): element i of
// dx[B, H, W, C], so that a warp's lanes gather consecutive channels.
template <typename T>
CG_OP("avg_pool2d_nhwc_backward",
      "pattern: gather",
      "forward: avg_pool2d_nhwc",
      "types: T = f32 f16 bf16",
      "tensor: dout input T",
      "tensor: dx output T",
      "arg: kernel_h int",
      "arg: kernel_w int",
      "arg: stride_h int",
      "arg: stride_w int",
      "arg: padding_h int = 0",
      "arg: padding_w int = 0",
      "arg: count_include_pad bool = true",
      "shape: dout:[B, (H + 2 * padding_h - kernel_h) / stride_h + 1, (W + 2 * padding_w - kernel_w) / stride_w + 1, C] -> dx:[B, H, W, C]",
      "doc: gradient of avg_pool2d_nhwc: each window's dout spread evenly over what it averaged")
CG_DEVICE float cg_avg_pool2d_nhwc_backward(const T* dout, cg_i64 i, cg_pool2d_window p, bool count_include_pad, int C) {
  const cg_i64 pixel = i / C;
  const int w = (int)(pixel % p.W), h = (int)(pixel / p.W % p.H);
  return cg_avg_pool2d_backward_pixel(dout, pixel / ((cg_i64)p.W * p.H) * p.OH * p.OW * C + i % C, C, h, w, p,
                                      count_include_pad);
}

// dx at pixel (h, w) of an image whose cells' douts are at out_base, pixels
// `pixel` elements apart: each output cell whose rows and columns
// (cg_adaptive_avg_pool2d's) hold it, its dout over the cell's area.
template <typename T>
CG_DEVICE float cg_adaptive_avg_pool2d_backward_pixel(const T* dout, cg_i64 out_base, cg_i64 pixel, int h, int w, int H,
                                                      int W, int OH, int OW) {
  float sum = 0.0f;
  for (int oh = 0; oh < OH; ++oh) {
    const int h0 = oh * H / OH, h1 = ((oh + 1) * H + OH - 1) / OH;
    if (h < h0 || h >= h1) continue;
    for (int ow = 0; ow < OW; ++ow) {
      const int w0 = ow * W / OW, w1 = ((ow + 1) * W + OW - 1) / OW;
      if (w >= w0 && w < w1)
        sum += cg_widen(cg_load(dout, out_base + ((cg_i64)oh * OW + ow) * pixel)) / (float)((h1 - h0) * (w1 - w0));
    }
  }
  return sum;
}

// dx[i]: each output cell whose rows and columns (cg_adaptive_avg_pool2d's)
// hold element i, its dout over the cell's area.
template <typename T>
CG_OP("adaptive_avg_pool2d_backward",
      "pattern: gather",
      "forward: adaptive_avg_pool2d",
      "types: T = f32 f16 bf16",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: dout:[...S, OH, OW] -> dx:[...S, H, W]",
      "doc: gradient of adaptive_avg_pool2d: each cell's dout spread evenly over the elements it averaged")
CG_DEVICE float cg_adaptive_avg_pool2d_backward(const T* dout, cg_i64 i, int H, int W, int OH, int OW) {
  const int w = (int)(i % W), h = (int)(i / W % H);
  return cg_adaptive_avg_pool2d_backward_pixel(dout, i / ((cg_i64)W * H) * OH * OW, 1, h, w, H, W, OH, OW);
}

// dx[i] of channels-last tensors (dout and dx NHWC): element i of dx[B, H, W, C].
template <typename T>
CG_OP("adaptive_avg_pool2d_nhwc_backward",
      "pattern: gather",
      "forward: adaptive_avg_pool2d_nhwc",
      "types: T = f32 f16 bf16",
      "tensor: dout input T",
      "tensor: dx output T",
      "shape: dout:[B, OH, OW, C] -> dx:[B, H, W, C]",
      "doc: gradient of adaptive_avg_pool2d_nhwc: each cell's dout spread evenly over the elements it averaged")
CG_DEVICE float cg_adaptive_avg_pool2d_nhwc_backward(const T* dout, cg_i64 i, int H, int W, int OH, int OW, int C) {
  const cg_i64 pixel = i / C;
  const int w = (int)(pixel % W), h = (int)(pixel / W % H);
  return cg_adaptive_avg_pool2d_backward_pixel(dout, pixel / ((cg_i64)W * H) * OH * OW * C + i % C, C, h, w, H, W, OH, OW);
}

// BatchNorm in training mode (torch.nn.functional.batch_norm, training=True)
// over NCHW: channel c is normalised by the mean and the biased variance of
// its B x H x W elements, then scaled by weight[c] and shifted by bias[c];
// its mean and 1 / sqrt(var + eps) are saved for the gradient, and the
// running statistics, where bound, move toward the batch's by `momentum`
// (the running variance toward the unbiased variance, as PyTorch keeps it).
// A block a channel, its elements walked through load_x(i) and store(i, v),
// i in [0, count): two passes for the statistics (the mean, then the squared
// deviations from it: no cancellation), one to write. `scratch` holds 32
// floats of shared memory. Returns the statistics to every thread.
struct cg_batchnorm2d_stats {
  float mean, var, rstd;  // var: the biased variance
};
template <typename LoadX, typename Store>
CG_OP("batchnorm2d",
      "pattern: opaque",
      "autocast: f32",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: weight weight T optional",
      "tensor: bias weight T optional",
      "tensor: running_mean weight f32 optional writes",
      "tensor: running_var weight f32 optional writes",
      "tensor: out output T",
      "tensor: mean output f32",
      "tensor: rstd output f32",
      "arg: eps float = 1e-5",
      "arg: momentum float = 0.1",
      "shape: x:[B, C, H, W] weight:[C] bias:[C] running_mean:[C] running_var:[C] -> out:[B, C, H, W] mean:[C] rstd:[C] running_mean:[C] running_var:[C]",
      "backward: batchnorm2d_backward",
      "flops: 8 * numel(x)",
      "doc: torch.nn.functional.batch_norm in training mode over NCHW: batch statistics per channel, the running statistics updated in place")
CG_DEVICE cg_batchnorm2d_stats cg_batchnorm2d_channel(LoadX load_x, Store store, cg_i64 count, float weight, float bias,
                                                      float eps, float* scratch) {
  float partial = 0.0f;
  for (cg_i64 i = threadIdx.x; i < count; i += blockDim.x) partial += load_x(i);
  const float mean = cg_block_sum(partial, scratch) / (float)count;
  partial = 0.0f;
  for (cg_i64 i = threadIdx.x; i < count; i += blockDim.x) {
    const float d = load_x(i) - mean;
    partial += d * d;
  }
  const float var = cg_block_sum(partial, scratch) / (float)count;
  const float rstd = 1.0f / sqrtf(var + eps);
  for (cg_i64 i = threadIdx.x; i < count; i += blockDim.x) store(i, (load_x(i) - mean) * rstd * weight + bias);
  return cg_batchnorm2d_stats{mean, var, rstd};
}

// A channel's sums in batchnorm2d's gradient: those of its weight and bias.
struct cg_batchnorm2d_sums {
  float dweight, dbias;
};

// batchnorm2d's gradients, a block a channel: with xhat = (x - mean) * rstd,
// dweight = sum(dout * xhat), dbias = sum(dout), and
// dx = weight * rstd * (dout - dbias / count - xhat * dweight / count).
// Returns the channel's dweight and dbias to every thread.
template <typename LoadX, typename LoadDout, typename StoreDx>
CG_OP("batchnorm2d_backward",
      "pattern: opaque",
      "forward: batchnorm2d",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: weight weight T optional",
      "tensor: mean input f32",
      "tensor: rstd input f32",
      "tensor: dout input T",
      "tensor: dx output T optional",
      "tensor: dweight output T optional",
      "tensor: dbias output T optional",
      "shape: x:[B, C, H, W] weight:[C] mean:[C] rstd:[C] dout:[B, C, H, W] -> dx:[B, C, H, W] dweight:[C] dbias:[C]",
      "doc: gradients of batchnorm2d (training mode) with respect to x, weight and bias")
CG_DEVICE cg_batchnorm2d_sums cg_batchnorm2d_backward_channel(LoadX load_x, LoadDout load_dout, StoreDx store_dx, cg_i64 count,
                                                       float mean, float rstd, float weight, float* scratch) {
  float sum_dy = 0.0f, sum_dy_xhat = 0.0f;
  for (cg_i64 i = threadIdx.x; i < count; i += blockDim.x) {
    const float dy = load_dout(i);
    sum_dy += dy;
    sum_dy_xhat += dy * (load_x(i) - mean) * rstd;
  }
  const float dbias = cg_block_sum(sum_dy, scratch), dweight = cg_block_sum(sum_dy_xhat, scratch);
  for (cg_i64 i = threadIdx.x; i < count; i += blockDim.x) {
    const float xhat = (load_x(i) - mean) * rstd;
    store_dx(i, weight * rstd * (load_dout(i) - (dbias + xhat * dweight) / (float)count));
  }
  return cg_batchnorm2d_sums{dweight, dbias};
}

// BatchNorm in training mode over channels-last tensors ([B, H, W, C]):
// batchnorm2d's computation, laid out so that a warp reads runs of
// consecutive channels. A block covers a chunk of LANES x V channels (each
// of a thread row's LANES threads takes V consecutive channels, one access
// of 16 bytes where C allows) and a range of pixels, which its 256 / LANES
// rows of threads walk. Each thread keeps Welford's running mean and sum of
// squared deviations (m2) of its channels; the rows' moments are then
// merged in row order by Chan's pairwise formula: no E[x^2] - E[x]^2
// cancellation, and a fixed order, so the same bits every run. A large
// tensor splits its pixels over `splits` blocks a chunk: each stores its
// moments in a workspace, and the chunk's block that arrives last merges the
// splits in order (cg_batchnorm2d_nhwc_statistics); a second kernel, laid
// out alike, then normalises (cg_batchnorm2d_nhwc_normalize). A small one (and the
// megakernel, which has no workspace) takes a block a chunk over every
// pixel, statistics and output in one kernel (cg_batchnorm2d_nhwc_chunk).
// The gradient is laid out alike: its two sums per channel, then dx.
struct cg_moments {
  float count, mean, m2;  // m2: the sum of squared deviations from mean
};

// Chan, Golub and LeVeque's update: the moments of a's values and b's together.
CG_DEVICE cg_moments cg_moments_merge(cg_moments a, cg_moments b) {
  if (b.count == 0.0f) return a;
  if (a.count == 0.0f) return b;
  const float count = a.count + b.count, d = b.mean - a.mean, f = b.count / count;
  return cg_moments{count, a.mean + d * f, a.m2 + b.m2 + d * d * a.count * f};
}

CG_DEVICE cg_batchnorm2d_stats cg_batchnorm2d_stats_of(cg_moments m, float eps) {
  const float var = m.m2 / m.count;  // biased, as batch statistics are
  return cg_batchnorm2d_stats{m.mean, var, 1.0f / sqrtf(var + eps)};
}

// V per-channel values from channel c0 (a multiple of V, so aligned): f32
// statistics as 16- or 8-byte loads where V allows, a weight or bias as one
// vector (null: `absent` for each).
template <int V>
CG_DEVICE void cg_load_channels(const float* p, cg_i64 c0, float* out) {
  constexpr int W = V % 4 == 0 ? 4 : V % 2 == 0 ? 2 : 1;
  CG_UNROLL
  for (int k = 0; k < V; k += W) {
    const cg_vector<W, float> v = cg_load_vector<W>(p, c0 + k);
    CG_UNROLL
    for (int j = 0; j < W; ++j) out[k + j] = v.v[j];
  }
}
template <int V, typename T>
CG_DEVICE void cg_load_channels(const T* p, cg_i64 c0, float absent, float* out) {
  if (p == nullptr) {
    for (int k = 0; k < V; ++k) out[k] = absent;
    return;
  }
  const cg_vector<V, T> v = cg_load_vector<V>(p, c0);
  CG_UNROLL
  for (int k = 0; k < V; ++k) out[k] = cg_widen(v.v[k]);
}

// A block's threads over a chunk of channels: THREADS threads (more in a
// megakernel's block idle), ROWS rows of LANES, ITEMS channels (a thread
// each where a chunk's channels are merged). The rows' values in shared
// memory take SHARED_FLOATS floats. Each row walks its pixels in order.
template <int V, int LANES>
struct cg_batchnorm2d_nhwc_layout {
  static constexpr int THREADS = 256, ROWS = THREADS / LANES, ITEMS = LANES * V, SHARED_FLOATS = 2 * ROWS * ITEMS;
  // Pixels a thread loads before it uses them: a block's 256 threads keep
  // 4 x 16 bytes each in flight, what an SM needs to come near its share of
  // DRAM bandwidth at two blocks (Little's law, about 1 us of latency).
  static constexpr int UNROLL = 4;
  static CG_DEVICE int lane() { return (int)(threadIdx.x % LANES); }
  static CG_DEVICE int row() { return (int)(threadIdx.x / LANES); }
  // The first of this thread's V channels in chunk `chunk` (C or past it where the chunk ends first).
  static CG_DEVICE cg_i64 first_channel(cg_i64 chunk) { return (chunk * LANES + lane()) * V; }
  // The end of the split of pixels that starts at `begin` (per_split each, the last fewer).
  static CG_DEVICE cg_i64 split_end(cg_i64 begin, cg_i64 per_split, cg_i64 pixels) {
    return begin + per_split < pixels ? begin + per_split : pixels;
  }
  // How many of pixels [begin, end) row r walks (begin + r, then every ROWS-th).
  static CG_DEVICE float row_pixels(cg_i64 begin, cg_i64 end, int r) {
    return end - begin > r ? (float)((end - begin - r + ROWS - 1) / ROWS) : 0.0f;
  }
  // Walks this thread's pixels of [begin, end) in order, UNROLL at a time:
  // load(u, p) for each of them first (their loads in flight together),
  // then use(u, p) for each, u the pixel's place in the group.
  template <typename Load, typename Use>
  static CG_DEVICE void walk_pixels(cg_i64 begin, cg_i64 end, Load load, Use use) {
    for (cg_i64 p = begin + row(); p < end; p += UNROLL * ROWS) {
      CG_UNROLL
      for (int u = 0; u < UNROLL; ++u)
        if (p + u * ROWS < end) load(u, p + u * ROWS);
      CG_UNROLL
      for (int u = 0; u < UNROLL; ++u) {
        if (p + u * ROWS >= end) break;
        use(u, p + u * ROWS);
      }
    }
  }
  // Each row's two values a channel (this thread's V of each) into shared
  // memory, then thread `item` < ITEMS merges the rows of channel item in
  // row order by merge(r, first, second). Every thread calls it.
  template <typename Merge>
  static CG_DEVICE void merge_rows(const float* first, const float* second, float* smem, Merge merge) {
    __syncthreads();  // the caller's previous use of smem is over
    if (threadIdx.x < THREADS)
      for (int k = 0; k < V; ++k) {
        smem[row() * ITEMS + lane() * V + k] = first[k];
        smem[(ROWS + row()) * ITEMS + lane() * V + k] = second[k];
      }
    __syncthreads();
    if (threadIdx.x < ITEMS)
      for (int r = 0; r < ROWS; ++r) merge(r, smem[r * ITEMS + threadIdx.x], smem[(ROWS + r) * ITEMS + threadIdx.x]);
  }
};

// The moments of channel chunk * ITEMS + threadIdx.x (threads below ITEMS)
// over pixels [begin, end) of x.
template <int V, int LANES, typename T>
CG_DEVICE cg_moments cg_batchnorm2d_nhwc_moments(const T* x, cg_i64 C, cg_i64 chunk, cg_i64 begin, cg_i64 end,
                                                 float* smem) {
  typedef cg_batchnorm2d_nhwc_layout<V, LANES> L;
  const cg_i64 c0 = L::first_channel(chunk);
  float count = 0.0f, mean[V], m2[V];
  CG_UNROLL
  for (int k = 0; k < V; ++k) mean[k] = m2[k] = 0.0f;
  cg_vector<V, T> v[L::UNROLL];
  if (threadIdx.x < L::THREADS && c0 < C)
    L::walk_pixels(
        begin, end, [&](int u, cg_i64 p) { v[u] = cg_load_vector<V>(x, p * C + c0); },
        [&](int u, cg_i64) {
          count += 1.0f;
          const float inv = 1.0f / count;  // one division for the V channels
          CG_UNROLL
          for (int k = 0; k < V; ++k) {
            const float value = cg_widen(v[u].v[k]), d = value - mean[k];
            mean[k] += d * inv;
            m2[k] += d * (value - mean[k]);
          }
        });
  cg_moments total{0.0f, 0.0f, 0.0f};
  L::merge_rows(mean, m2, smem, [&](int r, float mean_r, float m2_r) {
    total = cg_moments_merge(total, cg_moments{L::row_pixels(begin, end, r), mean_r, m2_r});
  });
  return total;
}

// A large tensor's splits of a chunk: item threadIdx.x's two values of this
// split (of channel c, where `mine`) into partials ([splits][2][C]: the
// firsts, then the seconds), then, in the chunk's block that arrives last
// at arrivals[chunk], merge(s, first, second) over the splits in order.
// Returns whether this thread merged. word: a word of shared memory.
template <typename Merge>
CG_DEVICE bool cg_batchnorm2d_nhwc_merge_splits(float first, float second, bool mine, cg_i64 c, cg_i64 C, int split,
                                                int splits, cg_i64 chunk, float* partials, unsigned int* arrivals,
                                                unsigned int* word, Merge merge) {
  if (mine) {
    cg_store(partials, 2 * split * C + c, first);
    cg_store(partials, (2 * split + 1) * C + c, second);
  }
  if (!cg_last_to_arrive(arrivals + chunk, splits, word) || !mine) return false;
  for (int s = 0; s < splits; ++s)
    merge(s, cg_load_l2(partials, 2 * s * C + c), cg_load_l2(partials, (2 * s + 1) * C + c));
  return true;
}

// A large tensor's statistics: block (split, chunk) stores the moments of
// its pixels [split * per_split, +per_split) to partials ([splits][2][C]:
// the means, then the m2s), and the chunk's block that arrives last at
// arrivals[chunk] merges the splits in order and hands each channel's
// statistics to f(c, stats) (one split: that block, directly). smem:
// SHARED_FLOATS floats, then a word. Every thread of the block calls it.
template <int V, int LANES, typename T, typename F>
CG_OP("batchnorm2d_nhwc",
      "pattern: opaque",
      "autocast: f32",
      "variant: cg_batchnorm2d_nhwc_chunk",
      "variant: cg_batchnorm2d_nhwc_normalize",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: weight weight T optional",
      "tensor: bias weight T optional",
      "tensor: running_mean weight f32 optional writes",
      "tensor: running_var weight f32 optional writes",
      "tensor: out output T",
      "tensor: mean output f32",
      "tensor: rstd output f32",
      "arg: eps float = 1e-5",
      "arg: momentum float = 0.1",
      "shape: x:[B, H, W, C] weight:[C] bias:[C] running_mean:[C] running_var:[C] -> out:[B, H, W, C] mean:[C] rstd:[C] running_mean:[C] running_var:[C]",
      "backward: batchnorm2d_nhwc_backward",
      "flops: 8 * numel(x)",
      "doc: batchnorm2d on channels-last tensors: batch statistics per channel (the last axis), the running statistics updated in place")
CG_DEVICE void cg_batchnorm2d_nhwc_statistics(const T* x, cg_i64 C, cg_i64 pixels, cg_i64 per_split, int split,
                                              int splits, cg_i64 chunk, float eps, float* partials,
                                              unsigned int* arrivals, float* smem, F f) {
  typedef cg_batchnorm2d_nhwc_layout<V, LANES> L;
  const cg_i64 begin = (cg_i64)split * per_split, end = L::split_end(begin, per_split, pixels);
  const cg_moments m = cg_batchnorm2d_nhwc_moments<V, LANES>(x, C, chunk, begin, end, smem);
  const cg_i64 c = chunk * L::ITEMS + threadIdx.x;
  const bool mine = threadIdx.x < L::ITEMS && c < C;
  if (splits == 1) {
    if (mine) f(c, cg_batchnorm2d_stats_of(m, eps));
    return;
  }
  cg_moments total{0.0f, 0.0f, 0.0f};
  if (cg_batchnorm2d_nhwc_merge_splits(m.mean, m.m2, mine, c, C, split, splits, chunk, partials, arrivals,
                                       (unsigned int*)(smem + L::SHARED_FLOATS), [&](int s, float mean_s, float m2_s) {
                                         const cg_i64 b = (cg_i64)s * per_split;
                                         const float count = (float)(L::split_end(b, per_split, pixels) - b);
                                         total = cg_moments_merge(total, cg_moments{count, mean_s, m2_s});
                                       }))
    f(c, cg_batchnorm2d_stats_of(total, eps));
}

// A large tensor's output, laid out as its statistics (block (split,
// chunk), the same pixels): each thread loads its channels' statistics,
// weights and biases once, then normalises, scales and shifts its V
// channels of each of its pixels (weight and bias may be null: 1 and 0);
// store(e, values) stores elements e to e + V - 1.
template <int V, int LANES, typename T, typename Store>
CG_DEVICE void cg_batchnorm2d_nhwc_normalize(const T* x, const float* mean, const float* rstd, const T* weight,
                                             const T* bias, cg_i64 C, cg_i64 pixels, cg_i64 per_split, int split,
                                             cg_i64 chunk, Store store) {
  typedef cg_batchnorm2d_nhwc_layout<V, LANES> L;
  const cg_i64 c0 = L::first_channel(chunk);
  if (threadIdx.x >= L::THREADS || c0 >= C) return;
  float mu[V], scale[V], w[V], shift[V];
  cg_load_channels<V>(mean, c0, mu);
  cg_load_channels<V>(rstd, c0, scale);
  cg_load_channels<V>(weight, c0, 1.0f, w);
  cg_load_channels<V>(bias, c0, 0.0f, shift);
  CG_UNROLL
  for (int k = 0; k < V; ++k) scale[k] *= w[k];
  const cg_i64 begin = (cg_i64)split * per_split, end = L::split_end(begin, per_split, pixels);
  cg_vector<V, T> v[L::UNROLL];
  L::walk_pixels(
      begin, end, [&](int u, cg_i64 p) { v[u] = cg_load_vector<V>(x, p * C + c0); },
      [&](int u, cg_i64 p) {
        float out[V];
        CG_UNROLL
        for (int k = 0; k < V; ++k) out[k] = (cg_widen(v[u].v[k]) - mu[k]) * scale[k] + shift[k];
        store(p * C + c0, out);
      });
}

// A small tensor (or a megakernel's tile): block `chunk` computes its
// channels' statistics over every pixel, hands each to f(c, stats), then
// normalises its channels of every pixel (store as above). smem:
// SHARED_FLOATS floats.
template <int V, int LANES, typename T, typename F, typename Store>
CG_DEVICE void cg_batchnorm2d_nhwc_chunk(const T* x, const T* weight, const T* bias, cg_i64 C, cg_i64 pixels,
                                         cg_i64 chunk, float eps, float* smem, F f, Store store) {
  typedef cg_batchnorm2d_nhwc_layout<V, LANES> L;
  const cg_moments m = cg_batchnorm2d_nhwc_moments<V, LANES>(x, C, chunk, 0, pixels, smem);
  const cg_i64 c = chunk * L::ITEMS + threadIdx.x;
  __syncthreads();  // every row's moments are merged: smem holds the chunk's scale and shift next
  if (threadIdx.x < L::ITEMS && c < C) {
    const cg_batchnorm2d_stats s = cg_batchnorm2d_stats_of(m, eps);
    f(c, s);
    smem[threadIdx.x] = s.mean;
    smem[L::ITEMS + threadIdx.x] = s.rstd * (weight ? cg_widen(cg_load(weight, c)) : 1.0f);
    smem[2 * L::ITEMS + threadIdx.x] = bias ? cg_widen(cg_load(bias, c)) : 0.0f;
  }
  __syncthreads();
  const cg_i64 c0 = L::first_channel(chunk);
  if (threadIdx.x >= L::THREADS || c0 >= C) return;
  const float* mean = smem + L::lane() * V;
  for (cg_i64 p = L::row(); p < pixels; p += L::ROWS) {
    const cg_vector<V, T> v = cg_load_vector<V>(x, p * C + c0);
    float out[V];
    CG_UNROLL
    for (int k = 0; k < V; ++k) out[k] = (cg_widen(v.v[k]) - mean[k]) * mean[L::ITEMS + k] + mean[2 * L::ITEMS + k];
    store(p * C + c0, out);
  }
}

// The gradient's sums of channel chunk * ITEMS + threadIdx.x (threads
// below ITEMS) over pixels [begin, end): dbias = sum(dout) and
// dweight = sum(dout * xhat), xhat = (x - mean) * rstd.
template <int V, int LANES, typename T>
CG_DEVICE cg_batchnorm2d_sums cg_batchnorm2d_nhwc_block_sums(const T* x, const T* dout, const float* mean,
                                                             const float* rstd, cg_i64 C, cg_i64 chunk, cg_i64 begin,
                                                             cg_i64 end, float* smem) {
  typedef cg_batchnorm2d_nhwc_layout<V, LANES> L;
  const cg_i64 c0 = L::first_channel(chunk);
  float sum_dy[V], sum_dy_xhat[V], mu[V], rs[V];
  CG_UNROLL
  for (int k = 0; k < V; ++k) sum_dy[k] = sum_dy_xhat[k] = 0.0f;
  if (threadIdx.x < L::THREADS && c0 < C) {
    cg_load_channels<V>(mean, c0, mu);
    cg_load_channels<V>(rstd, c0, rs);
    cg_vector<V, T> xv[L::UNROLL], dv[L::UNROLL];
    L::walk_pixels(
        begin, end,
        [&](int u, cg_i64 p) {
          xv[u] = cg_load_vector<V>(x, p * C + c0);
          dv[u] = cg_load_vector<V>(dout, p * C + c0);
        },
        [&](int u, cg_i64) {
          CG_UNROLL
          for (int k = 0; k < V; ++k) {
            const float dy = cg_widen(dv[u].v[k]);
            sum_dy[k] += dy;
            sum_dy_xhat[k] += dy * (cg_widen(xv[u].v[k]) - mu[k]) * rs[k];
          }
        });
  }
  cg_batchnorm2d_sums total{0.0f, 0.0f};
  L::merge_rows(sum_dy_xhat, sum_dy, smem, [&](int, float dweight, float dbias) {
    total.dweight += dweight;
    total.dbias += dbias;
  });
  return total;
}

// dx of one element: weight * rstd * (dout - (dbias + xhat * dweight) / count), as batchnorm2d_backward.
CG_DEVICE float cg_batchnorm2d_dx(float dy, float xhat, float scale, float dweight, float dbias, float count) {
  return scale * (dy - (dbias + xhat * dweight) / count);
}

// The gradient's sums of a large tensor, split over pixels as
// cg_batchnorm2d_nhwc_statistics splits them (partials [splits][2][C]:
// the dweights, then the dbiases); f(c, sums) in the last block of the
// chunk (or the one, where one split).
template <int V, int LANES, typename T, typename F>
CG_OP("batchnorm2d_nhwc_backward",
      "pattern: opaque",
      "variant: cg_batchnorm2d_nhwc_backward_chunk",
      "variant: cg_batchnorm2d_nhwc_backward_dx",
      "forward: batchnorm2d_nhwc",
      "types: T = f32 f16 bf16",
      "tensor: x input T",
      "tensor: weight weight T optional",
      "tensor: mean input f32",
      "tensor: rstd input f32",
      "tensor: dout input T",
      "tensor: dx output T optional",
      "tensor: dweight output T optional",
      "tensor: dbias output T optional",
      "shape: x:[B, H, W, C] weight:[C] mean:[C] rstd:[C] dout:[B, H, W, C] -> dx:[B, H, W, C] dweight:[C] dbias:[C]",
      "doc: gradients of batchnorm2d_nhwc (training mode) with respect to x, weight and bias")
CG_DEVICE void cg_batchnorm2d_nhwc_gradient_sums(const T* x, const T* dout, const float* mean, const float* rstd,
                                                 cg_i64 C, cg_i64 pixels, cg_i64 per_split, int split, int splits,
                                                 cg_i64 chunk, float* partials, unsigned int* arrivals, float* smem,
                                                 F f) {
  typedef cg_batchnorm2d_nhwc_layout<V, LANES> L;
  const cg_i64 begin = (cg_i64)split * per_split, end = L::split_end(begin, per_split, pixels);
  const cg_batchnorm2d_sums s = cg_batchnorm2d_nhwc_block_sums<V, LANES>(x, dout, mean, rstd, C, chunk, begin, end, smem);
  const cg_i64 c = chunk * L::ITEMS + threadIdx.x;
  const bool mine = threadIdx.x < L::ITEMS && c < C;
  if (splits == 1) {
    if (mine) f(c, s);
    return;
  }
  cg_batchnorm2d_sums total{0.0f, 0.0f};
  if (cg_batchnorm2d_nhwc_merge_splits(s.dweight, s.dbias, mine, c, C, split, splits, chunk, partials, arrivals,
                                       (unsigned int*)(smem + L::SHARED_FLOATS), [&](int, float dweight, float dbias) {
                                         total.dweight += dweight;
                                         total.dbias += dbias;
                                       }))
    f(c, total);
}

// dx of a large tensor, laid out as its sums (block (split, chunk)): each
// thread loads its channels' statistics, weights and sums (sums[c]:
// dweight, sums[C + c]: dbias, f32 as summed) once, then stores its V
// channels of dx at each of its pixels.
template <int V, int LANES, typename T, typename Store>
CG_DEVICE void cg_batchnorm2d_nhwc_backward_dx(const T* x, const T* dout, const float* mean, const float* rstd,
                                               const T* weight, const float* sums, cg_i64 C, cg_i64 pixels,
                                               cg_i64 per_split, int split, cg_i64 chunk, Store store) {
  typedef cg_batchnorm2d_nhwc_layout<V, LANES> L;
  const cg_i64 c0 = L::first_channel(chunk);
  if (threadIdx.x >= L::THREADS || c0 >= C) return;
  float mu[V], rs[V], scale[V], dweight[V], dbias[V];
  cg_load_channels<V>(mean, c0, mu);
  cg_load_channels<V>(rstd, c0, rs);
  cg_load_channels<V>(weight, c0, 1.0f, scale);
  cg_load_channels<V>(sums, c0, dweight);
  cg_load_channels<V>(sums, C + c0, dbias);
  CG_UNROLL
  for (int k = 0; k < V; ++k) scale[k] *= rs[k];
  const float count = (float)pixels;
  const cg_i64 begin = (cg_i64)split * per_split, end = L::split_end(begin, per_split, pixels);
  cg_vector<V, T> xv[L::UNROLL], dv[L::UNROLL];
  L::walk_pixels(
      begin, end,
      [&](int u, cg_i64 p) {
        xv[u] = cg_load_vector<V>(x, p * C + c0);
        dv[u] = cg_load_vector<V>(dout, p * C + c0);
      },
      [&](int u, cg_i64 p) {
        float dx[V];
        CG_UNROLL
        for (int k = 0; k < V; ++k)
          dx[k] = cg_batchnorm2d_dx(cg_widen(dv[u].v[k]), (cg_widen(xv[u].v[k]) - mu[k]) * rs[k], scale[k], dweight[k],
                                    dbias[k], count);
        store(p * C + c0, dx);
      });
}

// The gradient of a small tensor (or a megakernel's tile): block `chunk`
// sums its channels over every pixel, hands them to f(c, sums), then
// stores its channels' dx of every pixel through store (null: none asked
// for). smem: SHARED_FLOATS floats.
template <int V, int LANES, typename T, typename F, typename Store>
CG_DEVICE void cg_batchnorm2d_nhwc_backward_chunk(const T* x, const T* dout, const float* mean, const float* rstd,
                                                  const T* weight, cg_i64 C, cg_i64 pixels, cg_i64 chunk, float* smem,
                                                  bool dx, F f, Store store) {
  typedef cg_batchnorm2d_nhwc_layout<V, LANES> L;
  const cg_batchnorm2d_sums s = cg_batchnorm2d_nhwc_block_sums<V, LANES>(x, dout, mean, rstd, C, chunk, 0, pixels, smem);
  const cg_i64 c = chunk * L::ITEMS + threadIdx.x;
  __syncthreads();  // every row's sums are added: smem holds the chunk's factors next
  if (threadIdx.x < L::ITEMS && c < C) {
    f(c, s);
    const float r = cg_load(rstd, c);
    smem[threadIdx.x] = cg_load(mean, c);
    smem[L::ITEMS + threadIdx.x] = r;
    smem[2 * L::ITEMS + threadIdx.x] = r * (weight ? cg_widen(cg_load(weight, c)) : 1.0f);
    smem[3 * L::ITEMS + threadIdx.x] = s.dweight;
    smem[4 * L::ITEMS + threadIdx.x] = s.dbias;
  }
  __syncthreads();
  const cg_i64 c0 = L::first_channel(chunk);
  if (!dx || threadIdx.x >= L::THREADS || c0 >= C) return;
  const float* at = smem + L::lane() * V;
  for (cg_i64 p = L::row(); p < pixels; p += L::ROWS) {
    const cg_vector<V, T> xv = cg_load_vector<V>(x, p * C + c0), dv = cg_load_vector<V>(dout, p * C + c0);
    float out[V];
    CG_UNROLL
    for (int k = 0; k < V; ++k)
      out[k] = cg_batchnorm2d_dx(cg_widen(dv.v[k]), (cg_widen(xv.v[k]) - at[k]) * at[L::ITEMS + k], at[2 * L::ITEMS + k],
                                 at[3 * L::ITEMS + k], at[4 * L::ITEMS + k], (float)pixels);
    store(p * C + c0, out);
  }
}

// A general permutation of axes: out's axis j is x's axis dims[j]
// (torch.permute; a transpose of any two axes is one). Element i of out
// reads x at sum_j coordinate_j(i) * source_strides[j], where
// source_strides[j] is the stride of x's axis dims[j]. The emitter checks
// that dims is a permutation and that out's shape is x's, permuted.
template <typename T>
CG_OP("permute",
      "pattern: gather",
      "types: T = " CG_FLOAT_TYPES,
      "tensor: x input T",
      "tensor: out output T",
      "arg: dims int[]",
      "shape: x:[...S] -> out:[...R]; numel(x) == numel(out)",
      "doc: out = x.permute(dims): out's axis j is x's axis dims[j]")
CG_DEVICE T cg_permute(const T* x, cg_i64 i, int rank, const cg_i64* out_dims, const cg_i64* source_strides) {
  cg_i64 source = 0;
  for (int j = rank - 1; j >= 0; --j) {
    source += i % out_dims[j] * source_strides[j];
    i /= out_dims[j];
  }
  return cg_load(x, source);
}
