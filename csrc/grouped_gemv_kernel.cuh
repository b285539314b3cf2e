// Grouped MoE GEMV on tensor cores: out[s, :] = x[s, :] @ W[expert(s)].T for every row s, all
// experts in one launch, routing read on the device (no host sync: CUDA-graph capturable).
//
// The decode of a K tile is gemv_kernel.cuh's (pair table, mma_tile); what differs is the work:
//  * per-row mode (decode, few rows), balanced plan (grouped_gemv_rows_kernel, below): row s's
//    expert is expert_ids[s] (a row of an id outside [0, E) is written as zeros), and the rows' row
//    tiles are one list cut into equal contiguous shares, as the dense GEMV's balanced plan cuts a
//    weight's; where a CTA's share would touch more than 8 rows or their x would not fit in shared
//    memory, units (row s, row group) in this kernel;
//  * grouped mode (prefill): the caller groups rows by expert on the device
//    (_ops.expert_offsets: order, offsets) and a unit is (expert, chunk of <= 8 NT of its rows,
//    row group), so each weight tile is decoded once for up to 8 NT rows. Every CTA turns the
//    offsets into a chunk prefix sum in shared memory and finds a unit's expert by binary search;
//    the grid writes the rows of no expert as zeros.
// A CTA's kGemvWarps warps cover row_tiles x k_warps (row tile, K lane); activations are staged
// per unit in K sub-chunks, the k_warps partial sums of a row tile are added in shared memory in
// warp order (deterministic), and each output row is written once. Rotated experts (kRotate
// instantiations, rot_signs: one rotation for all, they read the same x) stage x R, as the GEMV does
// (stage_x, rotate_segment): per unit and K pass, a few float32 operations per staged element against a
// unit's whole weight tile. The host takes it in per-row mode; in grouped mode, where every unit of a
// row's expert would rotate the row again, it rotates x once with the standalone kernel (kbit_api.cu).
#pragma once

#include "gemv_kernel.cuh"

namespace kbit {

// A SiLU-gated activation (p.x2 set, kbit_grouped_gemv_silu_mul): element i of x row r is
// silu_times(x[r, i], x2[r, i]), rows at a pitch of x_stride elements (the halves of an experts layer's
// gate_up output), so the down projection stages the gated rows without the separate kernel and its
// [rows, k] round trip. row_of: the kernel's x row of a unit's token.
template <typename T, typename RowOf> struct GatedX {
  union Run { uint4 u; T e[8]; };
  const T* gate;
  const T* up;
  int64_t stride;
  RowOf row_of;
  bool vec_ok;  // 16-byte aligned rows: vector loads

  __device__ GatedX(const GroupedParams& p, RowOf rows)
      : gate(static_cast<const T*>(p.x)), up(static_cast<const T*>(p.x2)), stride(p.x_stride), row_of(rows) {
    const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
    vec_ok = p.k % 8 == 0 && stride % 8 == 0 && aligned(gate) && aligned(up);
  }
  // The run of token tok at element kk: kk + 0..3 and kk + kSecond + 0..3, zero beyond k.
  template <int kSecond> __device__ __forceinline__ uint4 run(int tok, int64_t kk, int64_t k) const {
    const int64_t at = row_of(tok) * stride + kk;
    Run out;
    if (vec_ok && kk + 4 + kSecond <= k) {
      Run g, u;
      g.u = load_run<kSecond>(gate + at);
      u.u = load_run<kSecond>(up + at);
#pragma unroll
      for (int e = 0; e < 8; ++e) out.e[e] = silu_times(g.e[e], u.e[e]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int o = e < 4 ? e : e - 4 + kSecond;
        out.e[e] = kk + o < k ? silu_times(gate[at + o], up[at + o]) : from_float<T>(0.f);
      }
    }
    return out.u;
  }
};

// stage_x of a grouped kernel: x itself, or the gated rows where p.x2 is set (per-row mode only, kGated:
// the grouped mode's NT = 4 instantiations spill registers with a second staging inlined).
template <int BITS, typename T, int kUnroll, bool kRotate, bool kGated, typename RowOf>
__device__ __forceinline__ void stage_grouped_x(const GroupedParams& p, int m, RowOf row_of, uint32_t* xs, int64_t kc0,
                                                int64_t kc1) {
  const T* x = static_cast<const T*>(p.x);
  if (kGated && p.x2)
    stage_x<BITS, T, kUnroll, kRotate>(x, p.k, m, row_of, xs, kc0, kc1, GatedX<T, RowOf>(p, row_of), NoWork{},
                                       p.rot_signs);
  else
    stage_x<BITS, T, kUnroll, kRotate>(x, p.k, m, row_of, xs, kc0, kc1, PlainX{}, NoWork{}, p.rot_signs);
}

template <int BITS, typename T, int NT, bool kRotate>
__global__ void __launch_bounds__(kGemvThreads, kGemvCtasPerSm) grouped_gemv_kernel(GroupedParams p) {
  constexpr int kDepth = kGemvDepth;
  constexpr int kMaxTok = 8 * NT;
  extern __shared__ float4 smem_f4[];
  char* table = reinterpret_cast<char*>(smem_f4);
  uint32_t* xs = reinterpret_cast<uint32_t*>(table + kGemvTableBytes + kGemvScaleBytes);
  float* red = reinterpret_cast<float*>(xs + static_cast<int64_t>(p.sub_kt) * gemv_x_tile_bytes(kMaxTok) / 4);
  int64_t* unit_rows = reinterpret_cast<int64_t*>(red + kGemvWarps * kMaxTok * kTileN);  // [kMaxTok]: out rows
  int* chunk_start = reinterpret_cast<int*>(unit_rows + kMaxTok);  // [E + 1], grouped mode

  // A programmatic dependent launch (sm_90+): the table build reads only the codebook and
  // overlaps the previous kernel's tail; the routing and x are read after it has completed.
  build_table<BITS, T>(table, codebook_lane<BITS>(p.codebook, threadIdx.x & 31));
  wait_for_primary_grid();
  allow_dependent_launch();

  const bool grouped = p.order != nullptr;
  const int num_experts = static_cast<int>(p.e);
  if (grouped) {
    // chunk_start[e] = sum over e' < e of ceil(rows of e' / kMaxTok): each thread counts a run
    // of experts, a block-wide scan (warp shuffles, then the 8 warp totals) offsets the runs.
    __shared__ int warp_total[kGemvWarps];
    const int per = (num_experts + kGemvThreads - 1) / kGemvThreads;
    const int e0 = min(num_experts, static_cast<int>(threadIdx.x) * per), e1 = min(num_experts, e0 + per);
    int local = 0;
    for (int e = e0; e < e1; ++e)
      local += static_cast<int>((p.offsets[e + 1] - p.offsets[e] + kMaxTok - 1) / kMaxTok);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = local;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    int base = incl - local;
    for (int w = 0; w < warp; ++w) base += warp_total[w];
    if (threadIdx.x == 0) chunk_start[0] = 0;
    for (int e = e0; e < e1; ++e) {
      base += static_cast<int>((p.offsets[e + 1] - p.offsets[e] + kMaxTok - 1) / kMaxTok);
      chunk_start[e + 1] = base;
    }
    // Rows of no expert (order[0 : offsets[0]] and order[offsets[E] : s], ids outside [0, E)) are zeros,
    // spread over the grid (usually there are none).
    T* out = static_cast<T*>(p.out);
    const int64_t lo = p.offsets[0], hi = p.offsets[num_experts], none = (lo + p.s - hi) * p.n;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kGemvThreads + threadIdx.x; i < none;
         i += static_cast<int64_t>(gridDim.x) * kGemvThreads) {
      const int64_t r = i / p.n, pos = r < lo ? r : hi + (r - lo);
      out[p.order[pos] * p.n + i % p.n] = from_float<T>(0.f);
    }
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  const int k_warps = p.k_warps, row_tiles = kGemvWarps / k_warps;
  const int rt = warp / k_warps, kw = warp % k_warps;
  const int64_t n_tiles = (p.n + kTileN - 1) / kTileN, k_tiles = (p.k + kTileK - 1) / kTileK;
  const int64_t groups = (n_tiles + row_tiles - 1) / row_tiles;
  const int64_t work = grouped ? chunk_start[num_experts] : p.s;
  const int64_t units = work * groups;
  const int expert_tiles = static_cast<int>(n_tiles * k_tiles);
  const uint32_t lane_word = table_lane_word<BITS, false>(lane, 0);
  const int64_t x_repeat = p.x_repeat;  // row s reads x row s / x_repeat (an experts layer's token rows, top-k each)
  T* out = static_cast<T*>(p.out);

  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t wi = u / groups, group = u % groups;
    int64_t expert, first;  // grouped: rows order[first .. first + m); per-row: row first
    int m;
    if (grouped) {
      int lo = 0, hi = num_experts;  // last e with chunk_start[e] <= wi
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (chunk_start[mid] <= wi) lo = mid; else hi = mid;
      }
      expert = lo;
      first = p.offsets[lo] + (wi - chunk_start[lo]) * kMaxTok;
      m = static_cast<int>(min(static_cast<int64_t>(kMaxTok), p.offsets[lo + 1] - first));
    } else {
      expert = p.expert_ids[wi];
      first = wi;
      m = 1;
      if (expert < 0 || expert >= p.e) {  // no expert: the unit's outputs are zeros (uniform over the CTA)
        const int64_t n0 = group * row_tiles * kTileN, n1 = min(p.n, n0 + row_tiles * kTileN);
        for (int64_t n = n0 + threadIdx.x; n < n1; n += kGemvThreads) out[wi * p.n + n] = from_float<T>(0.f);
        continue;
      }
    }
    __syncthreads();  // the previous unit's output writes are done with unit_rows
    if (static_cast<int>(threadIdx.x) < m) unit_rows[threadIdx.x] = grouped ? p.order[first + threadIdx.x] : first;
    auto row_of = [&](int tok) -> int64_t { return unit_rows[tok]; };
    auto x_row_of = [&](int tok) -> int64_t { return x_repeat == 1 ? unit_rows[tok] : unit_rows[tok] / x_repeat; };
    const int32_t* planes = p.planes + expert * expert_tiles * (BITS * 64);
    const uint8_t* scales = p.block_scales + expert * expert_tiles * 64;
    const int64_t tile_n = group * row_tiles + rt;
    const bool active = tile_n < n_tiles;
    const int live_nt = (m + 7) / 8;  // token tiles holding rows of this unit

    float acc[2][NT][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[a][nt][i] = 0.f;

    for (int64_t ks = 0; ks < k_tiles; ks += p.sub_kt) {
      const int64_t ke = min(k_tiles, ks + p.sub_kt);
      const int64_t tile_base = tile_n * k_tiles;
      const int64_t kt0 = ks + kw;
      TileWords<BITS> buf[kDepth];
#pragma unroll
      for (int d = 0; d < kDepth - 1; ++d) {
        const int64_t ktd = kt0 + d * k_warps;
        if (active && ktd < ke) load_tile<BITS>(planes, scales, static_cast<int>(tile_base + ktd), lane, buf[d]);
      }
      __syncthreads();  // the previous pass's / unit's readers are done with xs and red
      stage_grouped_x<BITS, T, 2, kRotate, NT == 1>(p, m, x_row_of, xs, ks, ke);
      __syncthreads();
      if (!active) continue;
      for (int64_t kt = kt0; kt < ke; kt += kDepth * k_warps) {
#pragma unroll
        for (int d = 0; d < kDepth; ++d) {
          const int64_t ktd = kt + d * k_warps;
          if (ktd >= ke) break;
          const int64_t ktn = ktd + (kDepth - 1) * k_warps;
          if (ktn < ke) load_tile<BITS>(planes, scales, static_cast<int>(tile_base + ktn), lane, buf[(d + kDepth - 1) % kDepth]);
          mma_tile<BITS, T, NT>(buf[d], reinterpret_cast<const uint2*>(xs) + (ktd - ks) * 8 * m * 4, live_nt, g, t,
                                table, lane_word, acc);
        }
      }
    }

    // Lane (g, t) holds rows g, g + 8 and tokens 8 nt + 2t, 8 nt + 2t + 1 of its row tile.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = nt * 8 + 2 * t + (e & 1), row = g + 8 * (e >> 1);
        if (tok < m) red[(warp * kMaxTok + tok) * kTileN + row] = acc[0][nt][e] + acc[1][nt][e];
      }
    }
    __syncthreads();
    const float* rscale = p.row_scales + expert * p.n;
    for (int i = threadIdx.x; i < row_tiles * m * kTileN; i += kGemvThreads) {
      const int rt2 = i / (m * kTileN), tok = (i / kTileN) % m, r2 = i % kTileN;
      const int64_t n = (group * row_tiles + rt2) * kTileN + r2;
      if (n >= p.n) continue;
      float v = 0.f;
      for (int w2 = 0; w2 < k_warps; ++w2) v += red[((rt2 * k_warps + w2) * kMaxTok + tok) * kTileN + r2];
      out[row_of(tok) * p.n + n] = from_float<T>(v * rscale[n]);
    }
  }
}

// Per-row mode, balanced plan (decode; the host sets p.cta_rows): the dense GEMV's balanced
// one-split plan over the problem's row tiles. Row tile j of problem row s is row tile j of expert
// expert_ids[s]; the s * n_tiles row tiles are cut into contiguous ranges, one per CTA (cta_rows each,
// the first (s * n_tiles) % grid CTAs one more), and a CTA's (row tile, K tile) items into equal
// contiguous shares, one per warp, whose plane loads run on across row tiles (and experts) with no
// barrier between them. A range touches at most p.row_span problem rows (the plan keeps it <= 8),
// staged once over all of K as the mma's token columns; a row tile of row s keeps column s - s0 of its
// sums. A row tile cut between warps is summed in shared memory in warp order (deterministic).
template <int BITS, typename T, bool kRotate>
__global__ void __launch_bounds__(kGemvThreads, kGemvCtasPerSm) grouped_gemv_rows_kernel(GroupedParams p) {
  constexpr int kDepth = kGemvDepth;
  extern __shared__ float4 smem_f4[];
  char* table = reinterpret_cast<char*>(smem_f4);
  uint32_t* xs = reinterpret_cast<uint32_t*>(table + kGemvTableBytes + kGemvScaleBytes);
  __shared__ int64_t row_expert[kGroupedRowSpanMax];

  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  // 32-bit tile arithmetic within an expert: the host guarantees n_tiles * k_tiles * BITS * 64 < 2^31,
  // and cta_rows * k_tiles < 2^31.
  const int n_tiles = static_cast<int>((p.n + kTileN - 1) / kTileN);
  const int k_tiles = static_cast<int>((p.k + kTileK - 1) / kTileK);
  const int n = static_cast<int>(p.n);
  const int cta = static_cast<int>(blockIdx.x), ctas = static_cast<int>(gridDim.x);
  const int64_t extra = p.s * n_tiles - p.cta_rows * ctas;
  const int rows = static_cast<int>(p.cta_rows + (cta < extra));
  const int64_t r0 = cta * p.cta_rows + min(static_cast<int64_t>(cta), extra);  // the range's first row tile
  const int cta_items = rows * k_tiles;
  const auto share_begin = [&](int w) { return static_cast<int>(static_cast<int64_t>(w) * cta_items / kGemvWarps); };
  const int i0 = share_begin(warp), items = share_begin(warp + 1) - i0;
  const int64_t s0 = r0 / n_tiles;
  const int m = rows > 0 ? static_cast<int>((r0 + rows - 1) / n_tiles - s0 + 1) : 0;

  // The table reads only the codebook, so it overlaps the previous kernel's tail (a programmatic
  // dependent launch, sm_90+); the routing and x are read after that kernel has completed.
  build_table<BITS, T>(table, codebook_lane<BITS>(p.codebook, lane));
  wait_for_primary_grid();
  allow_dependent_launch();
  if (static_cast<int>(threadIdx.x) < m) row_expert[threadIdx.x] = p.expert_ids[s0 + threadIdx.x];
  __syncthreads();

  // Row tile r of the range (CTA-relative): its problem row, its tile in the expert, its expert's
  // planes and scales at that tile's first K tile; false for a row of no expert (written as zeros).
  struct RowTile {
    int64_t row;
    int tn;
    bool valid;
    const int32_t* planes;
    const uint8_t* scales;
  };
  const auto row_tile = [&](int r) {
    RowTile rt;
    const int64_t tile = r0 + r;
    rt.row = tile / n_tiles;
    rt.tn = static_cast<int>(tile - rt.row * n_tiles);
    const int64_t e = row_expert[rt.row - s0];
    rt.valid = e >= 0 && e < p.e;
    const int64_t first = ((rt.valid ? e : 0) * n_tiles + rt.tn) * k_tiles;
    rt.planes = p.planes + first * (BITS * 64);
    rt.scales = p.block_scales + first * 64;
    return rt;
  };

  // Load cursor (row tile, K tile), kDepth - 1 items ahead of the decode cursor; the first loads go
  // out before the staging, so their latency overlaps it.
  int load_r = i0 / k_tiles, load_kt = i0 - load_r * k_tiles, load_i = 0;
  RowTile lt = row_tile(load_r);
  TileWords<BITS> buf[kDepth];
  const auto advance_load = [&](TileWords<BITS>& dst) {
    // A row of no expert decodes zeros (code 0 scales): its sums are discarded, but a stale
    // register's scale code would index past the scale pairs.
    if (load_i < items) {
      if (lt.valid) load_tile<BITS>(lt.planes, lt.scales, load_kt, lane, dst);
      else dst = TileWords<BITS>{};
    }
    ++load_i;
    if (++load_kt == k_tiles && load_i < items) {
      load_kt = 0;
      lt = row_tile(++load_r);
    }
  };
#pragma unroll
  for (int d = 0; d < kDepth - 1; ++d) advance_load(buf[d]);

  const int64_t x_repeat = p.x_repeat;  // row s reads x row s / x_repeat (an experts layer's token rows, top-k each)
  const auto x_row_of = [&](int tok) -> int64_t { return (s0 + tok) / x_repeat; };
  stage_grouped_x<BITS, T, 4, kRotate, true>(p, m, x_row_of, xs, 0, k_tiles);
  __syncthreads();

  const uint32_t lane_word = table_lane_word<BITS, false>(lane, 0);
  const uint2* xs2 = reinterpret_cast<const uint2*>(xs);
  T* out = static_cast<T*>(p.out);
  float acc[2][1][4] = {};
  const auto take_sums = [&](float (&y)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      y[e] = acc[0][0][e] + acc[1][0][e];
      acc[0][0][e] = 0.f;
      acc[1][0][e] = 0.f;
    }
  };
  // Decode cursor: row tile dt (CTA-relative) at K tile kt; the row scales of this lane's rows (g, g + 8).
  int dr = i0 / k_tiles, kt = i0 - dr * k_tiles;
  RowTile dt = row_tile(dr);
  float rs[2];
  const auto load_row_scales = [&] {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = dt.tn * kTileN + g + 8 * h;
      rs[h] = items > 0 && dt.valid && r < n ? __ldg(p.row_scales + (row_expert[dt.row - s0] * p.n + r)) : 0.f;
    }
  };
  load_row_scales();
  // Lane (g, t) holds rows g, g + 8 of tokens 2t, 2t + 1: the row tile's column is its row - s0.
  const auto store = [&](const float (&y)[4]) {
    const int col = static_cast<int>(dt.row - s0);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = dt.tn * kTileN + g + 8 * (e >> 1);
      if (2 * t + (e & 1) == col && r < n) out[dt.row * p.n + r] = from_float<T>(dt.valid ? y[e] * rs[e >> 1] : 0.f);
    }
  };

  float head[4];  // the unscaled sums of this warp's first segment where it starts inside its row tile
  bool sent_head = false;
  bool from_start = kt == 0;  // the current segment began at the row tile's first K tile
  for (int i = 0; i < items; i += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (i + d >= items) break;
      advance_load(buf[(d + kDepth - 1) % kDepth]);
      mma_tile<BITS, T, 1>(buf[d], xs2 + kt * 8 * m * 4, 1, g, t, table, lane_word, acc);
      if (++kt == k_tiles) {
        if (!from_start) {
          take_sums(head);  // the warp's first segment: at most one head
          sent_head = true;
        } else {
          float y[4];
          take_sums(y);
          store(y);
        }
        from_start = true;
        kt = 0;
        if (i + d + 1 < items) {
          dt = row_tile(++dr);
          load_row_scales();
        }
      }
    }
  }
  // A segment that stops inside its row tile: begun at the tile's first K tile, this warp owns the
  // tile and adds the heads of the next warps that start inside it, in warp order; begun inside, it
  // is such a head itself. The table is free once every warp has left the main loop.
  const bool owner = items > 0 && kt != 0 && from_start;
  if (items > 0 && kt != 0 && !from_start) {
    take_sums(head);
    sent_head = true;
  }
  float4* heads = reinterpret_cast<float4*>(table);  // [warp][lane]
  __syncthreads();
  if (sent_head) heads[warp * 32 + lane] = make_float4(head[0], head[1], head[2], head[3]);
  __syncthreads();
  if (owner) {
    float y[4];
    take_sums(y);
    const int tile_end = (dr + 1) * k_tiles;
    for (int w = warp + 1; w < kGemvWarps && share_begin(w) < tile_end; ++w) {
      if (share_begin(w) == share_begin(w + 1)) continue;  // a warp without items
      const float4 h = heads[w * 32 + lane];
      y[0] += h.x;
      y[1] += h.y;
      y[2] += h.z;
      y[3] += h.w;
    }
    store(y);
  }
}

template <auto kKernel>
cudaError_t launch_grouped_kernel(const GroupedParams& p, int grid, int smem, cudaStream_t stream) {
  const cudaError_t err = raise_smem_limit<kKernel>(smem);
  if (err != cudaSuccess) return err;
  const KernelLaunch launch(static_cast<unsigned>(grid), kGemvThreads, smem, stream, 1, use_pdl());
  return cudaLaunchKernelEx(&launch.config, kKernel, p);
}

// kRotate: rotated experts (p.rot_signs set), x R staged; where the kernel table has it. Per-row
// mode (NT = 1) takes the balanced kernel where the host planned it (p.cta_rows > 0).
template <int BITS, typename T, int NT, bool kRotate>
cudaError_t launch_grouped_gemv(const GroupedParams& p, int grid, cudaStream_t stream) {
  if constexpr (NT == 1) {
    if (p.cta_rows > 0)
      return launch_grouped_kernel<grouped_gemv_rows_kernel<BITS, T, kRotate>>(
          p, grid, grouped_rows_smem_bytes(p.row_span, static_cast<int>((p.k + kTileK - 1) / kTileK)), stream);
  }
  return launch_grouped_kernel<grouped_gemv_kernel<BITS, T, NT, kRotate>>(
      p, grid, grouped_smem_bytes(NT, p.sub_kt, p.order ? p.e : 0), stream);
}

}  // namespace kbit
