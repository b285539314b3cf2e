// Small-M GEMV on tensor cores: out[m, n] = sum_k x[m, k] * W[n, k] for M <= 8 * NT.
//
// Decode budget (H100, DESIGN.md section 5): at HBM speed a k = 4 weight leaves ~5 lane-op
// slots per element, and integer ops issue at half the float rate. So the multiply-adds go to
// the tensor cores (mma.sync m16n8k16, float32 accumulation) and the CUDA cores only decode:
//  * A warp owns a 16-row tile and walks K tiles (128 = 4 blocks of 32). Lane (g, t) =
//    (lane / 4, lane % 4) reads plane word (row g, block t) and (row g + 8, block t): each
//    plane is one fully used 128-byte line per warp, and each lane decodes a whole block of
//    its two rows.
//  * SWAR index extraction, ~0.5 integer ops per element: a few shift/LOP3 steps turn the k
//    plane words of a block into words whose byte b holds the codebook indices of an element
//    pair (k = 3..5: elements 8b+2s, 8b+2s+1 in word s) or quad (k = 2: 8b+{0,1,4,5} / {2,3,6,7}).
//  * One byte permute + one conflict-free shared-memory load per pair (quad for k = 2) from a
//    table of codebook pairs in the activation dtype, 32 (k = 2, 5: 16) lane-private copies;
//    the pair is then scaled by the block scale with one packed multiply and is an mma operand.
//  * The dot product over K is order-free, so the mma's K order is chosen to match the
//    decode: within a K tile, lane t's block supplies mma rows 2t, 2t+1, 2t+8, 2t+9 of every
//    chunk. The activations are staged in shared memory already permuted into that B-fragment
//    order (one 16-byte load per lane and two chunks), with columns = tokens, so M <= 8 costs one
//    mma per chunk and M <= 16 two.
// Work split (plan_gemv in kbit_api.cu): K is cut into `splits` ranges; a persistent CTA serves
// one range, stages its activations once, and its warps walk row tiles of it, each over the
// whole range, with no barrier after the staging. Split-K partials go to a float32 workspace
// that a second kernel reduces in split order (deterministic), or, in plans where each warp has
// at most one row tile, through distributed shared memory within a thread-block cluster of the
// splits' CTAs (sm_90+), summed in the same order. Balanced plans give each CTA of a split a
// contiguous range of row tiles and its warps equal contiguous shares of that range's (row tile,
// K tile) items, so no warp walks more than ceil(items / warps) K tiles: a row tile cut between
// warps is summed in shared memory after the main loop, in warp order. With K splits the row
// tile's sum goes to its split's workspace slice or, in a balanced cluster plan (sm_90+, its own
// kernel instantiation), the splits' CTAs of a row range form a cluster and CTA j % splits of it
// sums row tile j of the range in split order.
// Prologues (kPrologue instantiations, hf_kbit.fusion): the staging computes silu(g) * u, or an RMSNorm
// input w * (a [+ b]) whose per-token rsqrt(mean + eps) scales the sums in the epilogue (XPrologue,
// RowSquares).
// The GLU epilogue (kGlu instantiations, MmParams::glu; records, a prologue, the absolute table): the weight is a
// gated MLP's fused gate/up projection and the kernel writes silu(gate) * up, so the down projection after it
// stages a plain x instead of computing the SiLU-mul in every CTA. Its plan (glu_gemv_plan) is balanced and of
// one split, in pairs of row tiles: logical row tile 2j is gate tile j, 2j + 1 up tile j, so a CTA's range holds
// whole pairs; each finished row tile's scaled sums go to shared memory, and after the balanced epilogue's
// barriers the CTA writes each pair's silu_times of the two sums rounded to T (the unfused ops' roundings).
// A template flag: the row jump that alternates between the halves costs instructions in the K loop.
// Rotated layers (kRotate instantiations, MmParams::rot_signs): the staging turns what it would store into
// x R (after the prologue) before the store, so the K loop is the unrotated kernel's (stage_x, rotate_segment).
// A template flag, not a runtime one: the unrotated instantiations compile to the code they had before
// rotation existed (a runtime flag moved ptxas's register allocation in the K loop, 3-8% at M = 16).
// Block records (kOffsets instantiations, launch_gemv_offsets; format.py): block_scales holds an int16 per
// block, the E4M4 code in its low byte and a signed offset code o in its high byte. A lane loads its two
// records where it loaded two codes, takes the scale pair from the low byte as before and the offset pair
// kOffsetStep * o from the high byte (offset_pair), and the decode's packed multiply becomes a packed fma:
// (codebook pair * scale + offset), rounded once to the activation dtype. Again a template flag: the
// instantiations without it compile to the code they had before.
#pragma once

#include <type_traits>

#include "kbit_common.cuh"
#include "kbit_launch.h"
#include "rotation.cuh"

namespace kbit {

// ---- packed 16-bit pairs in the activation dtype ----

template <typename T> __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b);
template <> __device__ __forceinline__ uint32_t mul2<__half>(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
template <> __device__ __forceinline__ uint32_t mul2<__nv_bfloat16>(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r =
      __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// a * b + c, rounded once (the decode of block records: codebook pair * scale + offset).
template <typename T> __device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c);
template <> __device__ __forceinline__ uint32_t fma2<__half>(uint32_t a, uint32_t b, uint32_t c) {
  const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b),
                            *reinterpret_cast<const __half2*>(&c));
  return *reinterpret_cast<const uint32_t*>(&r);
}
template <> __device__ __forceinline__ uint32_t fma2<__nv_bfloat16>(uint32_t a, uint32_t b, uint32_t c) {
  const __nv_bfloat162 r = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b),
                                   *reinterpret_cast<const __nv_bfloat162*>(&c));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// d += a (16x16, row-major) * b (16x8, column-major), float32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ---- pair-table addressing ----
// A lookup's byte permute yields slot * 256 + lane copy offset. Relative mode adds the table's
// shared-window base to that (one add per lookup, 32 per K tile at k = 4: the compiler keeps
// the base in a register). Absolute mode (the GEMV, where shared memory allows) places the
// table at window address kTableWindow, whose byte 2 the permute supplies from the lane word,
// so its result is the address itself.
constexpr uint32_t kTableWindow = kGemvTablePad;  // 64 KB: byte 2 of the address is 1

// Byte 0: this lane's table copy (k = 5: replicated in every byte, for the high-bit words);
// absolute mode: byte 2 = kTableWindow >> 16 (k = 5 adds it in decode_pair) and byte 3 the
// window's top byte, `window_hi` (in a cluster launch CTA rank r's shared window starts at
// r << 24; k <= 4 only: k = 5 takes relative mode there).
template <int BITS, bool kAbs> __device__ __forceinline__ uint32_t table_lane_word(int lane, uint32_t window_hi) {
  const uint32_t w = BITS == 2 ? (lane & 15u) * 8u : BITS <= 4 ? lane * 4u : (lane & 15u) * 4u * 0x01010101u;
  return kAbs && BITS <= 4 ? w | kTableWindow | window_hi : w;
}

// The loads are plain (not volatile) asm so the compiler may schedule them freely: the table
// is written once before the kernels' first barrier, and every lookup's address depends on
// plane words loaded after it.
template <bool kAbs> __device__ __forceinline__ uint32_t table_address(const char* table, uint32_t off) {
  return kAbs ? off : static_cast<uint32_t>(__cvta_generic_to_shared(table)) + off;
}
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

// (a & mask) | (b & ~mask) as one LOP3 (the compiler otherwise splits it when b is a shift).
__device__ __forceinline__ uint32_t lop3_or_and(uint32_t a, uint32_t b, uint32_t mask) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(mask));
  return d;
}

// ---- the decode geometry ----

// K offset (within lane t's 32-element block) of the element pair that lane supplies as mma
// rows {2t, 2t+1} of chunk c; rows {2t+8, 2t+9} take the pair kPairB further on.
template <int BITS> __host__ __device__ constexpr int chunk_offset(int c) {
  return BITS == 2 ? 8 * (c >> 1) + 2 * (c & 1) : 16 * (c >> 2) + 2 * (c & 3);
}
template <int BITS> constexpr int kPairB = BITS == 2 ? 4 : 8;

// Swizzle of the 16-byte chunk pairs in a lane's activation record: the 8 lanes of a quarter-
// warp (one 16-byte load phase) then hit 8 different 4-bank groups.
__device__ __forceinline__ int x_swizzle(int g, int t) { return ((g * 4 + t) >> 1) & 3; }

// Pair table: 256 slots of 256 bytes (64 KB). k = 3, 4: slot = pair index i0 | i1 << 4, 32
// copies of a 4-byte pair in its first 128 bytes (the byte permute yields slot * 256 + lane * 4
// directly). k = 2: slot = quad index, 16 copies of an 8-byte quad in its first 128 bytes, lane
// l using copy l % 16 (an 8-byte load is served per half-warp, so lanes l and l + 16 never meet
// in one bank). k = 5: slot = the two low nibbles, then 4 (high bits) x 16 copies of a 4-byte
// pair (lane l uses copy l % 16). Only the bytes that lookups read are written (32 KB for
// k = 2-4): the CTAs that start last wait on the build.
template <typename T> __device__ __forceinline__ uint32_t scale_pair(uint32_t code);

// Codebook level lane % 2^BITS of this lane: build_table reads the levels from the warp's
// registers, so a kernel can load them first and let that load's latency overlap others.
template <int BITS> __device__ __forceinline__ float codebook_lane(const float* codebook, int lane) {
  return __ldg(codebook + (lane & ((1 << BITS) - 1)));
}

// Every warp of the block takes part (the levels come by shuffle from `levels`, the lane's
// codebook_lane); a warp's trip count is uniform because the table is a multiple of 32 x 16 bytes.
// kQuads: k = 2 as quads (the GEMV's decode); false: k = 2 as pairs in the k = 3, 4 layout, index
// nibbles 0..3 (the wgmma GEMM's decode, wgmma_kernel.cuh).
template <int BITS, typename T, bool kQuads = (BITS == 2)>
__device__ __forceinline__ void build_table(char* table, float levels) {
  constexpr int kLevels = 1 << BITS;
  const auto level = [&](int i) { return __shfl_sync(0xffffffffu, levels, i & (kLevels - 1)); };
  // After the pair table: the 256 E4M4 block scales as pairs of the activation dtype.
  for (int i = threadIdx.x; i < 256; i += blockDim.x)
    reinterpret_cast<uint32_t*>(table + kGemvTableBytes)[i] = scale_pair<T>(i);
  // 16-byte units written per slot: k = 2, 3, 4 read only a slot's first 128 bytes.
  constexpr int kUnits = BITS <= 4 ? 8 : 16;
  static_assert(256 * kUnits % (32 * 16) == 0, "build_table's shuffles need whole warps");
  for (int i = threadIdx.x; i < 256 * kUnits; i += blockDim.x) {
    const int slot = i / kUnits, within = (i % kUnits) * 16;
    uint4 v;
    if (BITS == 2 && kQuads) {
      // quad index bits: [1:0] element A.lo, [3:2] B.lo, [5:4] A.hi, [7:6] B.hi
      const uint32_t a = pack2<T>(level(slot), level(slot >> 4));
      const uint32_t b = pack2<T>(level(slot >> 2), level(slot >> 6));
      v = make_uint4(a, b, a, b);
    } else if (BITS <= 4) {
      const uint32_t a = pack2<T>(level(slot), level(slot >> 4));
      v = make_uint4(a, a, a, a);
    } else {
      const int hi = within >> 6;
      const uint32_t a = pack2<T>(level((slot & 15) | ((hi & 1) << 4)), level((slot >> 4) | ((hi >> 1) << 4)));
      v = make_uint4(a, a, a, a);
    }
    *reinterpret_cast<uint4*>(table + slot * 256 + within) = v;
  }
}

// Block scale (E4M4 code) as a pair of the activation dtype: exact in both (4-bit mantissa,
// exponents 2^-18 .. 2^4).
template <typename T> __device__ __forceinline__ uint32_t scale_pair(uint32_t code) {
  const float s = e4m4_decode(code);
  return pack2<T>(s, s);
}

// A block record's offset (kOffsets; the record sign-extended, so byte 1 is the offset code o in two's complement)
// as a pair of the activation dtype: kOffsetStep * o, exact in both (|o| <= 127: 7 significant bits, exponents
// 2^-3 .. 2^3). Built from the bits, three full-rate instructions and no int-to-float: fp16 puts o + 128 into the
// mantissa of 1024 (byte 1 into each half, its sign bit flipped, exponent 0x64) and one packed fma takes the 1152
// away while it scales; bf16's 8-bit significand cannot hold o + 128, so o goes into float32's 2^23 + 2^22 (one
// shift-add of the record), one fma takes that away while it scales, one pack rounds (exactly) to the pair. Computed
// rather than looked up: shared-memory loads are the decode's busiest pipe, and the scale pair already takes one per
// record.
static_assert(kOffsetStep == 0.125f, "offset_pair's constants assume kOffsetStep = 1/8 (format.OFFSET_STEP)");
template <typename T> __device__ __forceinline__ uint32_t offset_pair(uint32_t record);
template <> __device__ __forceinline__ uint32_t offset_pair<__half>(uint32_t record) {
  const uint32_t biased = __byte_perm(record, 0u, 0x4141u) ^ 0x64806480u;  // 1152 + o in each half
  const __half2 o = __hfma2(*reinterpret_cast<const __half2*>(&biased), __float2half2_rn(kOffsetStep),
                            __float2half2_rn(-1152.f * kOffsetStep));
  return *reinterpret_cast<const uint32_t*>(&o);
}
template <> __device__ __forceinline__ uint32_t offset_pair<__nv_bfloat16>(uint32_t record) {
  const float biased = __int_as_float(0x4B400000 + (static_cast<int32_t>(record) >> 8));  // 2^23 + 2^22 + o
  const float o = __fmaf_rn(biased, kOffsetStep, -12582912.f * kOffsetStep);
  return pack2<__nv_bfloat16>(o, o);
}

template <int BITS> struct TileWords {
  uint32_t w[2][BITS];  // plane words of (row g, block t) and (row g + 8, block t)
  uint32_t sc[2];       // their E4M4 block scale codes (kOffsets: their block records, sign-extended)
};

// kOffsets: scales_base points at int16 block records (format.py), in the layout of the codes.
template <int BITS, bool kOffsets = false>
__device__ __forceinline__ void load_tile(const int32_t* planes_base, const uint8_t* scales_base, int tile,
                                          int lane, TileWords<BITS>& tw) {
  const uint32_t* planes = reinterpret_cast<const uint32_t*>(planes_base) + tile * BITS * 64 + lane;
#pragma unroll
  for (int j = 0; j < BITS; ++j) {
    tw.w[0][j] = __ldcs(planes + j * 64);
    tw.w[1][j] = __ldcs(planes + j * 64 + 32);
  }
  if constexpr (kOffsets) {
    const short* rec = reinterpret_cast<const short*>(scales_base) + tile * 64 + lane;
    tw.sc[0] = static_cast<uint32_t>(static_cast<int32_t>(__ldcs(rec)));
    tw.sc[1] = static_cast<uint32_t>(static_cast<int32_t>(__ldcs(rec + 32)));
  } else {
    const unsigned char* sc = scales_base + tile * 64 + lane;
    tw.sc[0] = __ldcs(sc);
    tw.sc[1] = __ldcs(sc + 32);
  }
}

// A K tile of this lane's two rows (g, g + 8), ready for pair lookups: the SWAR index words
// and the block scales as activation-dtype pairs.
template <int BITS> struct TileIndex {
  // k = 2: w[r][0] byte b = quad 8b+{0,4,1,5}, w[r][1] = 8b+{2,6,3,7}.
  // k >= 3: w[r][s] byte b = pair (8b+2s, 8b+2s+1), low nibbles (k = 5: high bits in hb).
  uint32_t w[2][4];
  uint32_t hb[2][4];
  uint32_t s2[2];
  uint32_t o2[2];  // kOffsets: the blocks' offsets as activation-dtype pairs (offset_pair)
};

// kOffsets: tw holds block records; T, the activation dtype, is then that of the offset pairs.
template <int BITS, bool kOffsets = false, typename T = void>
__device__ __forceinline__ void index_words(const TileWords<BITS>& tw, const char* table, uint32_t lane_word,
                                            TileIndex<BITS>& ti) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if constexpr (kOffsets) {
      ti.s2[r] = reinterpret_cast<const uint32_t*>(table + kGemvTableBytes)[tw.sc[r] & 0xFFu];
      ti.o2[r] = offset_pair<T>(tw.sc[r]);
    } else {
      ti.s2[r] = reinterpret_cast<const uint32_t*>(table + kGemvTableBytes)[tw.sc[r]];
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t* pw = tw.w[r];
    if constexpr (BITS == 2) {
      ti.w[r][0] = lop3_or_and(pw[0], pw[1] << 1, 0x55555555u);
      ti.w[r][1] = lop3_or_and(pw[0] >> 1, pw[1], 0x55555555u);
    } else {
      // bit 2i / 2i+1 of u01 = planes 0 / 1 at bit 2i; v01 the same at bit 2i + 1.
      const uint32_t u01 = lop3_or_and(pw[0], pw[1] << 1, 0x55555555u);
      const uint32_t v01 = lop3_or_and(pw[0] >> 1, pw[1], 0x55555555u);
      if constexpr (BITS == 3) {
        // Nibble bit 3 is left as garbage: the table ignores it for k = 3.
        ti.w[r][0] = lop3_or_and(u01, pw[2] << 2, 0x33333333u);
        ti.w[r][2] = lop3_or_and(u01 >> 2, pw[2], 0x33333333u);
        ti.w[r][1] = lop3_or_and(v01, pw[2] << 1, 0x33333333u);
        ti.w[r][3] = lop3_or_and(v01 >> 2, pw[2] >> 1, 0x33333333u);
      } else {
        const uint32_t u23 = lop3_or_and(pw[2], pw[3] << 1, 0x55555555u);
        const uint32_t v23 = lop3_or_and(pw[2] >> 1, pw[3], 0x55555555u);
        ti.w[r][0] = lop3_or_and(u01, u23 << 2, 0x33333333u);
        ti.w[r][2] = lop3_or_and(u01 >> 2, u23, 0x33333333u);
        ti.w[r][1] = lop3_or_and(v01, v23 << 2, 0x33333333u);
        ti.w[r][3] = lop3_or_and(v01 >> 2, v23, 0x33333333u);
      }
      if constexpr (BITS == 5) {
        // byte b of hb: (high bit of element 8b+2s) << 6 | (of 8b+2s+1) << 7 | lane copy offset
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          // z keeps bits 0 and 4 of each byte, so z * 72 = z << 6 | z << 3 (no carries).
          const uint32_t z = (pw[4] >> s) & 0x11111111u;
          ti.hb[r][s] = ((z * 72u) & 0xC0C0C0C0u) | lane_word;
        }
      }
    }
  }
}

// The pair in byte b of index word w (k = 5: its high bits in byte b of hb, with the lane copy
// offset), scaled by the block-scale pair s2: one byte permute, one table load, one packed multiply
// (kOffsets: one packed fma, plus the block's offset pair o2).
template <int BITS, typename T, bool kAbs = false, bool kOffsets = false>
__device__ __forceinline__ uint32_t decode_pair_word(uint32_t w, uint32_t hb, uint32_t s2, int b, const char* table,
                                                     uint32_t lane_word, uint32_t o2 = 0u) {
  // Permute: byte 0 from the lane word (copy offset), byte 1 = the index byte, bytes 2-3 zero
  // (absolute mode: byte 2 = the window byte of the lane word).
  uint32_t off;
  if constexpr (BITS <= 4) {
    off = __byte_perm(lane_word, w, (kAbs ? 0x3200u : 0x1100u) | ((4u + b) << 4));
  } else {
    // byte 0 = this pair's high bits and copy offset, byte 1 = low nibbles
    const uint32_t hsrc = ((b < 2) ? (hb & 0xFFFFu) : (hb >> 16)) | (kAbs ? kTableWindow : 0u);
    off = __byte_perm(hsrc, w, (kAbs ? 0x3200u : 0x2200u) | ((4u + b) << 4) | (b & 1));
  }
  const uint32_t pair = lds32(table_address<kAbs>(table, off));
  if constexpr (kOffsets) return fma2<T>(pair, s2, o2);
  else return mul2<T>(pair, s2);
}

// k >= 3: elements (8b+2s, 8b+2s+1) of row r (0: g, 1: g + 8), scaled (kOffsets: and offset).
template <int BITS, typename T, bool kAbs = false, bool kOffsets = false>
__device__ __forceinline__ uint32_t decode_pair(const TileIndex<BITS>& ti, int r, int s, int b, const char* table,
                                                uint32_t lane_word) {
  return decode_pair_word<BITS, T, kAbs, kOffsets>(ti.w[r][s], BITS == 5 ? ti.hb[r][s] : 0u, ti.s2[r], b, table,
                                                   lane_word, kOffsets ? ti.o2[r] : 0u);
}

// k = 2: the quad in byte b of word q of row r, scaled: pairs (8b + 2q, +1) and (8b + 2q + 4, +1)
// (kOffsets: and offset).
template <typename T, bool kAbs = false, bool kOffsets = false>
__device__ __forceinline__ uint2 decode_quad(const TileIndex<2>& ti, int r, int q, int b, const char* table,
                                             uint32_t lane_word) {
  const uint32_t off = __byte_perm(lane_word, ti.w[r][q], (kAbs ? 0x3200u : 0x1100u) | ((4u + b) << 4));
  const uint2 e = lds64(table_address<kAbs>(table, off));
  if constexpr (kOffsets) return make_uint2(fma2<T>(e.x, ti.s2[r], ti.o2[r]), fma2<T>(e.y, ti.s2[r], ti.o2[r]));
  else return make_uint2(mul2<T>(e.x, ti.s2[r]), mul2<T>(e.y, ti.s2[r]));
}

// The mma A fragment (rows g, g + 8; K positions 2t, 2t + 1, 2t + 8, 2t + 9) of chunk c of this
// lane's two rows: register 2 h + r holds row g + 8 r, positions 2t + 8 h + {0, 1}.
template <int BITS, typename T, bool kAbs, bool kOffsets = false>
__device__ __forceinline__ void decode_chunk(const TileIndex<BITS>& ti, int c, const char* table, uint32_t lane_word,
                                             uint32_t (&a)[4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if constexpr (BITS == 2) {
      const uint2 e = decode_quad<T, kAbs, kOffsets>(ti, r, c & 1, c >> 1, table, lane_word);
      a[r] = e.x;
      a[2 + r] = e.y;
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        a[2 * h + r] = decode_pair<BITS, T, kAbs, kOffsets>(ti, r, c & 3, 2 * (c >> 2) + h, table, lane_word);
    }
  }
}

// Decode one K tile of this lane's two rows and run its 8 mma chunks against the staged
// activations `xs` (this tile's B fragments, uint2 per (chunk, token, t)) of token tiles
// 0 .. live_nt - 1 (warp-uniform: the grouped kernel's units of a few rows fill only the first
// of its NT token tiles; the others skip their B-fragment loads and multiply zeros). kOffsets: tw holds
// block records.
template <int BITS, typename T, int NT, bool kAbs = false, bool kOffsets = false>
__device__ __forceinline__ void mma_tile(const TileWords<BITS>& tw, const uint2* xs, int live_nt, int g, int t,
                                         const char* table, uint32_t lane_word, float (&acc)[2][NT][4]) {
  TileIndex<BITS> ti;
  index_words<BITS, kOffsets, T>(tw, table, lane_word, ti);

  // Lanes of tokens past the last row in a live token tile read whatever lies there (the next
  // K tile's records; after the last K tile, the dense GEMV's gemv_x_tail_bytes or the grouped
  // kernel's room for 8 NT rows): an mma column depends only on its own B column and those
  // columns are never stored. So every token tile is one constant offset from this lane's
  // record. Measured worse on the H100: a clamped address per token tile (registers live
  // through the K loop; the grouped k = 5 kernel spilled), and a per-lane predicate
  // (token < rows) instead of the per-tile one (grouped 3-10%, dense up to 8%).
  const uint4* xl = reinterpret_cast<const uint4*>(xs) + (g * 4 + t) * 4;
  const int sw = x_swizzle(g, t);
  uint4 bx[NT] = {};
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    if ((c & 1) == 0) {  // B fragments of chunks c, c + 1: one 16-byte load per token tile
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (nt == 0 || nt < live_nt) bx[nt] = xl[nt * 128 + ((c >> 1) ^ sw)];
    }
    uint32_t a[4];
    decode_chunk<BITS, T, kAbs, kOffsets>(ti, c, table, lane_word, a);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint32_t b0 = (c & 1) ? bx[nt].z : bx[nt].x, b1 = (c & 1) ? bx[nt].w : bx[nt].y;
      // NT = 1: two accumulator chains so that consecutive mma are independent (NT > 1 has NT).
      mma_16816<T>(acc[NT == 1 ? (c & 1) : 0][nt], a, b0, b1);
    }
  }
}

// The plain staging's element source: x itself (stage_x's vector loads).
struct PlainX {};

// 8 elements at p[0..3] and p[kSecond..kSecond + 3] (a staging run), 16-byte aligned for kSecond = 4,
// 8-byte aligned otherwise.
template <int kSecond> __device__ __forceinline__ uint4 load_run(const void* p) {
  if constexpr (kSecond == 4) return __ldg(static_cast<const uint4*>(p));
  const uint2 lo = __ldg(static_cast<const uint2*>(p)), hi = __ldg(static_cast<const uint2*>(p) + 2);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// silu(g) * u with the unfused ops' arithmetic and roundings: the SiLU in float32 as torch's kernel
// computes it (x / (1 + exp(-x)), IEEE division, the CUDA math library's expf), rounded to T, then the
// product, so a staged element equals the unfused ops' bit for bit.
template <typename T> __device__ __forceinline__ T silu_times(T g, T u) {
  const float f = to_float(g);
  return from_float<T>(to_float(from_float<T>(f / (1.f + expf(-f)))) * to_float(u));
}

// A prologue's element source (MmParams::prologue): the runs of the activation the GEMV multiplies,
// computed from x (and x2, norm_weight) as the staging reads them.
template <typename T> struct XPrologue {
  union Run { uint4 u; T e[8]; };
  const T* x;
  const T* x2;
  const T* w;
  int64_t x_stride, x2_stride;
  int kind;
  bool vec_ok;  // 16-byte aligned rows: vector loads

  __device__ XPrologue(const MmParams& p)
      : x(static_cast<const T*>(p.x)), x2(static_cast<const T*>(p.x2)), w(static_cast<const T*>(p.norm_weight)),
        x_stride(p.x_stride), x2_stride(p.x2_stride), kind(p.prologue) {
    const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
    vec_ok = p.k % 8 == 0 && x_stride % 8 == 0 && aligned(x) &&
             (kind == kPrologueNorm || (x2_stride % 8 == 0 && aligned(x2))) &&
             (kind == kPrologueSiluMul || aligned(w)) && (kind != kPrologueAddNorm || aligned(p.sum_out));
  }
  // x + x2 rounded to T, as the unfused add stores it.
  __device__ __forceinline__ static float add(T a, T b) { return to_float(from_float<T>(to_float(a) + to_float(b))); }
  // One element from its inputs: silu(g) * u (silu_times), or the norm weight times x (x + x2); the
  // token's rsqrt(mean + eps) scales its sums (gemv_kernel).
  __device__ __forceinline__ T apply(T a, T b, T wk) const {
    if (kind == kPrologueSiluMul) return silu_times(a, b);
    return from_float<T>(to_float(wk) * (kind == kPrologueAddNorm ? add(a, b) : to_float(a)));
  }
  // The run of token tok at element kk: kk + 0..3 and kk + kSecond + 0..3, zero beyond k.
  template <int kSecond> __device__ __forceinline__ uint4 run(int tok, int64_t kk, int64_t k) const {
    Run a, b, wk, out;
    const T* xs = x + tok * x_stride + kk;
    const T* x2s = x2 + tok * x2_stride + kk;
    if (vec_ok && kk + 4 + kSecond <= k) {
      a.u = load_run<kSecond>(xs);
      b.u = kind != kPrologueNorm ? load_run<kSecond>(x2s) : a.u;
      wk.u = kind != kPrologueSiluMul ? load_run<kSecond>(w + kk) : a.u;
#pragma unroll
      for (int e = 0; e < 8; ++e) out.e[e] = apply(a.e[e], b.e[e], wk.e[e]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int o = e < 4 ? e : e - 4 + kSecond;
        const bool in = kk + o < k;
        out.e[e] = in ? apply(xs[o], kind != kPrologueNorm ? x2s[o] : xs[o], kind != kPrologueSiluMul ? w[kk + o] : xs[o])
                      : from_float<T>(0.f);
      }
    }
    return out.u;
  }
};

// Under a norm prologue, each token's sum of squares of its whole row (x, or x + x2 rounded; a split
// stages only its K range), as per-warp partials warp_ss[warp][token] that the epilogue adds in warp
// order (deterministic, unlike atomics), and CTA 0 writes x + x2 to sum_out. Rows of whole warps of
// 8-element vectors: issue() loads the thread's first kVecs vectors before the staging, so their
// latency overlaps it, finish() after it sums them and loops over the rest. Other rows: a scalar loop.
template <typename T> struct RowSquares {
  static constexpr int kVecs = 2;
  union Run { uint4 u; T e[8]; };
  Run a[kVecs], b[kVecs];
  int vecs_per_row, vecs;  // 8-element vectors per row, of all rows
  bool fast;

  __device__ __forceinline__ void load(const XPrologue<T>& pr, int v, Run& av, Run& bv) const {
    const int tok = v / vecs_per_row;
    const int64_t kk = static_cast<int64_t>(v - tok * vecs_per_row) * 8;
    av.u = __ldg(reinterpret_cast<const uint4*>(pr.x + tok * pr.x_stride + kk));
    if (pr.kind == kPrologueAddNorm) bv.u = __ldg(reinterpret_cast<const uint4*>(pr.x2 + tok * pr.x2_stride + kk));
  }

  __device__ __forceinline__ void issue(const XPrologue<T>& pr, int64_t k, int m) {
    vecs_per_row = static_cast<int>(k / 8);
    vecs = vecs_per_row * m;
    fast = pr.vec_ok && vecs_per_row % 32 == 0;
    if (!fast) return;
#pragma unroll
    for (int r = 0; r < kVecs; ++r) {
      const int v = threadIdx.x + r * blockDim.x;
      if (v < vecs) load(pr, v, a[r], b[r]);
    }
  }

  __device__ __forceinline__ void finish(const XPrologue<T>& pr, int64_t k, int m, T* sum_out, float* warp_ss) {
    const bool add = pr.kind == kPrologueAddNorm, write = add && blockIdx.x == 0;
    const int lane = threadIdx.x & 31;
    float* my_ss = warp_ss + (threadIdx.x >> 5) * kGemvMaxM;  // this warp's partials, written by its lane 0 only
    // A warp's vectors lie in one row (vecs_per_row % 32 == 0).
    const auto sum = [&](int v, const Run& av, const Run& bv) {
      const int tok = v / vecs_per_row;
      Run h;
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float f = add ? XPrologue<T>::add(av.e[e], bv.e[e]) : to_float(av.e[e]);
        h.e[e] = from_float<T>(f);
        ss += f * f;
      }
      if (write) *reinterpret_cast<uint4*>(sum_out + tok * k + static_cast<int64_t>(v - tok * vecs_per_row) * 8) = h.u;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) my_ss[tok] += ss;
    };
    if (fast) {
#pragma unroll
      for (int r = 0; r < kVecs; ++r) {
        const int v = threadIdx.x + r * blockDim.x;
        if (v < vecs) sum(v, a[r], b[r]);
      }
      for (int v = threadIdx.x + kVecs * blockDim.x; v < vecs; v += blockDim.x) {
        Run av, bv;
        load(pr, v, av, bv);
        sum(v, av, bv);
      }
      return;
    }
    for (int tok = 0; tok < m; ++tok) {
      float ss = 0.f;
      for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
        const T xi = pr.x[tok * pr.x_stride + i];
        const float f = add ? XPrologue<T>::add(xi, pr.x2[tok * pr.x2_stride + i]) : to_float(xi);
        if (write) sum_out[tok * k + i] = from_float<T>(f);
        ss += f * f;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) my_ss[tok] += ss;
    }
  }
};

// Rotated layers: x R of one segment, 8 consecutive elements of a token in a thread's registers
// (rotation.cuh): the butterfly stages of strides 1, 2, 4 in the reference's order, float32, one
// rounding. `sign_bits`: the sign word of the segment's block shifted to its first element.
// The signs flip the 16-bit sign bits before the conversion (exact, as the reference's multiply by
// +-1): pair i of the segment (elements 2i, 2i + 1: sign bits 2i and 2i + 1) XORs its word with
// t * (2^(15 - 2i) + 2^(30 - 2i)) & 0x80008000, t the segment's sign bits alone, which moves bit 2i to 15
// and 2i + 1 to 31 (the two shifted copies of t never overlap, so the product carries nothing): a
// multiply and a LOP3 per pair, where a flip per float took a shift and a LOP3 per element.
template <typename T>
__device__ __forceinline__ uint4 rotate_segment(uint4 u, uint32_t sign_bits) {
  static_assert(sizeof(T) == 2, "the staging is 16-bit");
  union Run { uint4 u; uint32_t w[4]; T e[8]; };
  Run in;
  in.u = u;
  const uint32_t t = sign_bits & 0xFFu;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    constexpr uint32_t kSignBits = 0x80008000u;
    in.w[i] ^= (t * ((1u << (15 - 2 * i)) + (1u << (30 - 2 * i)))) & kSignBits;
  }
  float v[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // a word's two elements at once (bf16: a shift and a mask, exact)
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      v[2 * i] = __uint_as_float(in.w[i] << 16);
      v[2 * i + 1] = __uint_as_float(in.w[i] & 0xFFFF0000u);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&in.w[i]));
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
  butterfly_regs<1>(v);
  butterfly_regs<2>(v);
  butterfly_regs<4>(v);
  Run out;
#pragma unroll
  for (int i = 0; i < 4; ++i) out.w[i] = pack2<T>(__fmul_rn(v[2 * i], kRotScale), __fmul_rn(v[2 * i + 1], kRotScale));
  return out.u;
}

// Stage activation rows x[row(0..m-1), kc0*128 : kc1*128) in B-fragment order: lane (g, t)'s
// record of K tile j and token g holds its 8 chunks (64 bytes): 16-byte chunk pair q (chunks 2q,
// 2q + 1) at position q ^ swizzle, its 32-bit word (c % 2) * 2 + h the pair at K = (kc0 + j) * 128 +
// 32 t + chunk_offset(c) + h * kPairB. Thread (q, t) = (tid % 4, tid / 4 % 4) fills chunk pair q
// of lane t's records, one 16-byte store each (a quarter-warp writes 128 contiguous bytes): a
// chunk pair is the element run 8q .. 8q + 7 of the block (k = 2) or the runs o .. o + 3 and
// o + 8 .. o + 11 (o = 16 (q / 2) + 4 (q % 2)), words 0, 2, 1, 3 of the run(s). The (K tile, token)
// record advances by a step without integer division. x beyond K is zero: padded weights of a
// partial block may decode to nonzero levels. kUnroll: records loaded before the first store
// (staging is latency-bound otherwise); the GEMV takes 4, the grouped kernel 2 (with 4 its
// NT = 4 instantiation spilled and ran 10-12% slower at 16-64 tokens on the H100). fetch: PlainX
// (x itself, row_of(tok) rows of k) or an XPrologue, which computes each run from its inputs.
// between(): called once by every thread while its first loads are in flight (the GEMV builds its
// table there). kRotate: rot_signs are a rotated layer's sign words. Then thread (q, t) stages the
// segment 8q .. 8q + 7 of the block (one 16-byte load, rotate_segment), whose halves belong to two
// chunk pairs at k >= 3 (those of threads 2 (q / 2) and 2 (q / 2) + 1, words q % 2 and q % 2 + 2 of
// each): four 4-byte stores, where the runs of two neighbouring threads would need a shuffle per element.
struct NoWork {
  __device__ void operator()() const {}
};
template <int BITS, typename T, int kUnroll, bool kRotate = false, typename RowOf, typename Fetch = PlainX,
          typename Between = NoWork>
__device__ __forceinline__ void stage_x(const T* x, int64_t k, int m, RowOf row_of, uint32_t* xs, int64_t kc0,
                                        int64_t kc1, Fetch fetch = {}, Between between = {},
                                        const uint32_t* rot_signs = nullptr) {
  // Runs of 8 consecutive elements at k = 2 and on rotated layers (a whole segment each).
  constexpr bool kSegment = BITS == 2 || kRotate;
  constexpr int kSecond = kSegment ? 4 : 8;  // element offset of the run's second half
  union Run { uint4 u; uint32_t w[4]; T e[8]; };
  const int q = threadIdx.x & 3, t = (threadIdx.x >> 2) & 3, step = blockDim.x >> 4;
  const int e0 = 32 * t + (kSegment ? 8 * q : 16 * (q >> 1) + 4 * (q & 1));
  const int recs = static_cast<int>(kc1 - kc0) * m;  // record rec = j * m + token
  const bool vec_ok = (k % 8 == 0) && (reinterpret_cast<uintptr_t>(x) % 16 == 0);
  int rec = threadIdx.x >> 4;
  int j = rec / m, tok = rec - j * m;
  const int dj = step / m, dtok = step - dj * m;
  bool first = true;
  do {  // the first pass by every thread, for between()
    uint4 v[kUnroll];
    int dst[kUnroll];
    int swz[kRotate ? kUnroll : 1];  // the record's swizzle (rotated runs at k >= 3 store across chunk pairs)
    uint32_t sign_word[kRotate ? kUnroll : 1];  // the sign word of the record's segment
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) dst[r] = -1;
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
      if (rec >= recs) break;
      const int64_t kk = (kc0 + j) * kTileK + e0;
      const T* src = x + row_of(tok) * k + kk;
      Run run;
      if constexpr (!std::is_same_v<Fetch, PlainX>) {
        run.u = fetch.template run<kSecond>(tok, kk, k);
      } else if (vec_ok && kk + 4 + kSecond <= k) {
        if constexpr (kSegment) {
          run.u = __ldg(reinterpret_cast<const uint4*>(src));
        } else {
          const uint2 lo = __ldg(reinterpret_cast<const uint2*>(src)), hi = __ldg(reinterpret_cast<const uint2*>(src + 8));
          run.u = make_uint4(lo.x, lo.y, hi.x, hi.y);
        }
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int64_t o = (e < 4 ? e : e - 4 + kSecond);
          run.e[e] = kk + o < k ? src[o] : from_float<T>(0.f);
        }
      }
      if constexpr (kRotate) {
        v[r] = run.u;  // rotated, then stored in words 0, 2, 1, 3 (k = 2) or across two chunk pairs
        // k % 64 == 0: a segment past k is zero (no sign word to read). The segment's signs are bits
        // 8q .. 8q + 7 of the word (kk % 32 == 8q), shifted out where it is rotated: a shift here would
        // wait for the word before the next record's loads go out.
        sign_word[r] = kk < k ? __ldg(rot_signs + (kk >> 5)) : 0u;
      } else {
        v[r] = make_uint4(run.w[0], run.w[2], run.w[1], run.w[3]);
      }
      dst[r] = ((rec * 4 + t) * 4 + (q ^ x_swizzle(tok & 7, t))) * 4;
      if constexpr (kRotate) swz[r] = x_swizzle(tok & 7, t);
      rec += step;
      j += dj;
      tok += dtok;
      if (tok >= m) {
        tok -= m;
        ++j;
      }
    }
    if (first) between();
    first = false;
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
      if constexpr (kRotate) {
        if (dst[r] >= 0) {
          const uint4 u = rotate_segment<T>(v[r], sign_word[r] >> (8 * q));
          if constexpr (BITS == 2) {
            *reinterpret_cast<uint4*>(xs + dst[r]) = make_uint4(u.x, u.z, u.y, u.w);
          } else {
            // Elements 0-3 are the first run of chunk pair 2 (q / 2), 4-7 that of 2 (q / 2) + 1 (q even),
            // or their second runs (q odd): words q % 2 and q % 2 + 2 of each.
            uint32_t* record = xs + dst[r] - 4 * (q ^ swz[r]);
            uint32_t* lo = record + 4 * ((q & 2) ^ swz[r]) + (q & 1);
            uint32_t* hi = record + 4 * ((q | 1) ^ swz[r]) + (q & 1);
            lo[0] = u.x;
            lo[2] = u.y;
            hi[0] = u.z;
            hi[2] = u.w;
          }
        }
      } else {
        if (dst[r] >= 0) *reinterpret_cast<uint4*>(xs + dst[r]) = v[r];
      }
    }
  } while (rec < recs);
}

// The receive slots of cluster plans, after the staged x.
__device__ __forceinline__ float4* cluster_slots(uint32_t* xs, int chunk_kt, int m) {
  return reinterpret_cast<float4*>(reinterpret_cast<char*>(xs) + chunk_kt * gemv_x_tile_bytes(m) +
                                   gemv_x_tail_bytes(m));
}

// Balanced cluster plans: the scaled sums y of row tile j of the cluster's range go to slot
// (j / splits, split) of CTA j % splits, which sums them after the last cluster barrier. Before
// its first send a warp waits for the cluster's CTAs to have started (their arrive after the
// staging): `waited`.
template <int NT>
__device__ __forceinline__ void send_row_tile(float4* slots, int j, int splits, int split, int lane,
                                              const float (&y)[NT][4], bool& waited) {
  if (!waited) {
    cluster_wait();
    waited = true;
  }
  const int to = j % splits;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    st_cluster(slots + ((j - to + split) * NT + nt) * 32 + lane, to,
               make_float4(y[nt][0], y[nt][1], y[nt][2], y[nt][3]));
}

#if KBIT_TRACE
// KBIT_TRACE builds only (scripts/trace_gemv.py): lane 0 of each warp of a GEMV stamps the global
// timer at entry, after griddepcontrol.wait, after the x staging and at exit (the destructor, on
// every path out), then appends a record of kTraceWords words to the buffer of kbit_trace_set:
// word 0 counts the records (the caller zeroes it), records start at word kTraceWords.
constexpr int kTraceWords = 8;  // weight address, CTA << 32 | warp, SM, entry, wait, staged, exit, items
constexpr unsigned long long kTraceRecords = 1 << 16;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct GemvTrace {
  unsigned long long* buffer;
  const void* weight;
  unsigned long long t[4];
  unsigned long long items = 0;  // the warp's (row tile, K tile) items
  __device__ GemvTrace(unsigned long long* b, const void* w) : buffer(b), weight(w), t{global_ns(), 0, 0, 0} {}
  __device__ void stamp(int i) { t[i] = global_ns(); }
  __device__ ~GemvTrace() {
    if (!buffer || (threadIdx.x & 31) != 0) return;
    const unsigned long long exit = global_ns();
    const unsigned long long i = atomicAdd(buffer, 1ull);
    if (i >= kTraceRecords) return;
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    unsigned long long* r = buffer + (i + 1) * kTraceWords;
    r[0] = reinterpret_cast<uintptr_t>(weight);
    r[1] = (static_cast<unsigned long long>(blockIdx.x) << 32) | (threadIdx.x >> 5);
    r[2] = sm;
    r[3] = t[0];
    r[4] = t[1];
    r[5] = t[2];
    r[6] = exit;
    r[7] = items;
  }
};
#endif

// Persistent, barrier-free after the staging: CTA c serves K split c % splits (its x is staged
// once) and its warps walk row tiles of that split, each row tile over the whole split, with
// the plane loads pipelined across row-tile boundaries. A finished row tile goes straight to
// out (or to its split's workspace slice). kBalancedCluster: the balanced cluster plans (the
// host sets `cluster` and `balanced`). Their code lives only in that instantiation: in the
// others, even unused, it changed the machine code of the main loop, and M = 1 was 1-5% slower.
// kRotate: a rotated layer's instantiation (x R staged; the host picks it, rotation.cuh). kOffsets: a
// layer with block records (p.block_scales points at int16 records: launch_gemv_offsets).
template <int BITS, typename T, int NT, bool kAbs, bool kBalancedCluster, bool kPrologue, bool kRotate,
          bool kOffsets = false, bool kGlu = false>
__global__ void __launch_bounds__(kGemvThreads, kGemvCtasPerSm) gemv_kernel(MmParams p) {
  static_assert(!kGlu || !kBalancedCluster, "GLU plans are balanced plans of one split");
  constexpr int kDepth = kGemvDepth;
  extern __shared__ float4 smem_f4[];
  char* table = reinterpret_cast<char*>(smem_f4);
  uint32_t window_hi = 0;
  if constexpr (kAbs) {
    // The host sized dynamic shared memory for a window base of 0; the real base (after the
    // reserved and static shared memory, a few KB) only shortens the padding.
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_f4));
    window_hi = base & 0xFF000000u;
    if ((base & 0xFFFFFFu) > kTableWindow) __trap();  // cannot happen: static + reserved shared memory < 64 KB
    if (BITS == 5 && window_hi != 0) __trap();        // the host launches k = 5 clusters in relative mode
    table += kTableWindow - (base & 0xFFFFFFu);
  }
  uint32_t* xs = reinterpret_cast<uint32_t*>(table + kGemvTableBytes + kGemvScaleBytes);
  const int m = static_cast<int>(p.m);
#if KBIT_TRACE
  GemvTrace trace(p.trace, p.planes);
#endif

  // 32-bit tile arithmetic: the host guarantees n_tiles * k_tiles * BITS * 64 < 2^31.
  const int split = p.splits == 1 ? 0 : static_cast<int>(blockIdx.x % p.splits);
  const int k_tiles = static_cast<int>((p.k + kTileK - 1) / kTileK), n_tiles = static_cast<int>((p.n + kTileN - 1) / kTileN);
  const int kc0 = split * p.chunk_kt;
  const int kc1 = min(k_tiles, kc0 + p.chunk_kt);
  const int chunk = kc1 - kc0;
  const int n = static_cast<int>(p.n);

  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  // This warp's items (row tile, K tile of the split), row tile by row tile: `items` of them from
  // K tile kc0 + kt_start of first_tile, the next row tile `row_stride` further on.
  int first_tile, items, kt_start = 0, row_stride;
  // Balanced plans: the CTA's row tiles [r0, r0 + cta_items / chunk) and its warps' shares.
  int r0 = 0, cta_items = 0;
  // kGlu: logical row tile 2j is the gate tile j (physical j), 2j + 1 its up tile (physical half + j),
  // so that a CTA's range holds whole (gate, up) pairs.
  const int half = n_tiles / 2;
  const auto physical = [&](int tile) { return kGlu ? (tile & 1 ? half + (tile >> 1) : tile >> 1) : tile; };
  const auto share_begin = [&](int w) { return w * cta_items / kGemvWarps; };
  if (p.balanced) {
    // CTA c of split c % splits is CTA c / splits of that split's grid / splits. The first
    // n_tiles % (grid / splits) CTAs of a split take one row tile more. Back to back, the CTAs
    // launched last start last (on the SMs the previous call leaves last), so they are the
    // lighter ones. One-split plans: no integer division before the first loads, whose latency
    // a CTA that starts late waits on.
    const int cta = p.splits == 1 ? static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x / p.splits);
    const int ctas = p.splits == 1 ? static_cast<int>(gridDim.x) : static_cast<int>(gridDim.x / p.splits);
    // kGlu counts in pairs of row tiles (cta_rows is pairs per CTA).
    constexpr int unit = kGlu ? 1 : 0;
    const int per_cta = p.cta_rows, extra = (n_tiles >> unit) - per_cta * ctas;
    const int rows = (per_cta + (cta < extra)) << unit;
    r0 = (cta * per_cta + min(cta, extra)) << unit;
    cta_items = rows * chunk;
    const int i0 = share_begin(warp);
    first_tile = r0 + warp * rows / kGemvWarps;  // r0 + i0 / chunk: floor(floor(a / b) / c) = floor(a / (b c))
    kt_start = i0 - (first_tile - r0) * chunk;
    items = share_begin(warp + 1) - i0;
    row_stride = 1;
  } else {
    row_stride = static_cast<int>(gridDim.x / p.splits) * kGemvWarps;
    first_tile = static_cast<int>(blockIdx.x / p.splits) * kGemvWarps + warp;
    // A warp without a row tile still helps to build the table and stage x.
    const int my_tiles =
        first_tile < n_tiles && chunk > 0 ? (n_tiles - first_tile + row_stride - 1) / row_stride : 0;
    items = my_tiles * chunk;
  }
#if KBIT_TRACE
  trace.items = static_cast<unsigned long long>(items);
#endif

  // Load cursor (row tile, K tile) runs kDepth - 1 items ahead of the decode cursor. The first
  // loads (and the first row tile's scales, below) go out before the table build and the
  // staging, so their latency overlaps that prologue.
  int load_tile_idx = physical(first_tile) * k_tiles + kc0 + kt_start, load_kt = kc0 + kt_start, load_i = 0;
  // From the end of a row tile's range to the next's start: row_jump, or under kGlu (one split, row_stride 1)
  // alternately from gate tile j to up tile j and from up tile j to gate tile j + 1.
  const int row_jump = row_stride * k_tiles - chunk;
  int next_jump = row_jump, later_jump = row_jump;
  if constexpr (kGlu) {
    const int to_up = (half - 1) * k_tiles, to_gate = -half * k_tiles;
    next_jump = first_tile & 1 ? to_gate : to_up;
    later_jump = first_tile & 1 ? to_up : to_gate;
  }
  TileWords<BITS> buf[kDepth];
  auto advance_load = [&](TileWords<BITS>& dst) {
    if (load_i < items) load_tile<BITS, kOffsets>(p.planes, p.block_scales, load_tile_idx, lane, dst);
    ++load_i;
    ++load_tile_idx;
    if (++load_kt == kc1) {
      load_kt = kc0;
      load_tile_idx += next_jump;
      if constexpr (kGlu) {
        const int jump = next_jump;
        next_jump = later_jump;
        later_jump = jump;
      }
    }
  };
#pragma unroll
  for (int d = 0; d < kDepth - 1; ++d) advance_load(buf[d]);
  // Row scales of this lane's rows (g, g + 8) in the row tile being decoded.
  float rs[2];
  auto load_row_scales = [&](int tile) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = physical(tile) * kTileN + g + 8 * h;
      rs[h] = items > 0 && row < n ? __ldg(p.row_scales + row) : 0.f;
    }
  };
  load_row_scales(first_tile);

  // kPrologue: each warp's partial sums of squares per token under a norm prologue (RowSquares; zeroed
  // before the staging's barrier, which orders it before their updates).
  __shared__ float warp_ss[kPrologue ? kGemvWarps * kGemvMaxM : 1];
  if constexpr (kPrologue)
    if (threadIdx.x < kGemvWarps * kGemvMaxM) warp_ss[threadIdx.x] = 0.f;

  // A programmatic dependent launch (sm_90+): everything above reads only the packed weight
  // and its codebook, copied in or written by the quantize kernel, which fences its stores
  // (quantize_kernel.cuh), so the plane loads and row scales overlap the previous kernel's tail;
  // x is read after that kernel has completed. k <= 4 build the table while the first x loads
  // are in flight: the CTAs that start last (on the SMs the previous kernel leaves last) find the
  // wait already met, and end the call. k = 5's table, twice as large, takes longer than those
  // loads and is built before the wait. So is a rotated instantiation's: after the wait its staging
  // issues the rotation of every segment it stages, which built behind the table lengthened the
  // staging (docs/kernels.md#rotation). The next kernel may launch only after the wait
  // (kbit_common.cuh).
  const float levels = codebook_lane<BITS>(p.codebook, lane);
  // Constants the staging reads after the wait, this split's share, into L1 (prefetch_l1): a rotated layer's
  // sign words, and a norm prologue's weight, a model parameter, which no kernel that lets its dependents
  // launch early (ours, inductor's) writes. Between two calls of a layer a decode step streams the LM head
  // and every other layer through L2.
  if constexpr (kRotate)
    prefetch_l1(p.rot_signs, int64_t{kc0} * kBlocksPerTile, min(int64_t{kc1} * kBlocksPerTile, p.k / kBlockSize));
  if constexpr (kPrologue)
    if (p.prologue >= kPrologueNorm)
      prefetch_l1(static_cast<const T*>(p.norm_weight), int64_t{kc0} * kTileK, min(int64_t{kc1} * kTileK, p.k));
  if constexpr (BITS == 5 || kRotate) build_table<BITS, T>(table, levels);
  const auto table_build = [&] {
    if constexpr (BITS <= 4 && !kRotate) build_table<BITS, T>(table, levels);
  };
  wait_for_primary_grid();
#if KBIT_TRACE
  trace.stamp(1);
#endif
  allow_dependent_launch();
  const auto row_of = [](int tok) { return static_cast<int64_t>(tok); };
  if constexpr (kPrologue) {
    const XPrologue<T> prologue(p);
    const bool norm = p.prologue >= kPrologueNorm;
    RowSquares<T> squares;
    if (norm) squares.issue(prologue, p.k, m);
    stage_x<BITS, T, 4, kRotate>(static_cast<const T*>(p.x), p.k, m, row_of, xs, kc0, kc1, prologue, table_build,
                                 p.rot_signs);
    __syncthreads();
    if (norm) {
      squares.finish(prologue, p.k, m, static_cast<T*>(p.sum_out), warp_ss);
      __syncthreads();
    }
  } else {
    stage_x<BITS, T, 4, kRotate>(static_cast<const T*>(p.x), p.k, m, row_of, xs, kc0, kc1, PlainX{}, table_build,
                                 p.rot_signs);
    __syncthreads();
  }
#if KBIT_TRACE
  trace.stamp(2);
#endif
  if (p.cluster) cluster_arrive_relaxed();  // this CTA has started (waited for before the first remote store)
  else if (items == 0 && !p.balanced) return;  // balanced plans: every warp meets the epilogue's barriers

  // Byte 0 of the permute source: this lane's table copy (k = 5: replicated in every byte).
  const uint32_t lane_word = table_lane_word<BITS, kAbs>(lane, window_hi);
  const uint2* xs2 = reinterpret_cast<const uint2*>(xs);
  T* out = static_cast<T*>(p.out);
  float* ws = p.splits > 1 && !p.cluster ? p.workspace + static_cast<int64_t>(split) * p.m * p.n : nullptr;

  float acc[2][NT][4];
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[a][nt][i] = 0.f;

  // Lane (g, t) holds rows g, g + 8 and tokens 8 nt + 2t, 8 nt + 2t + 1 of a row tile: element
  // e of token tile nt is row g + 8 (e / 2), token 8 nt + 2t + e % 2.
  const auto take_sums = [&](float (&y)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        y[nt][e] = acc[0][nt][e] + acc[1][nt][e];
        acc[0][nt][e] = 0.f;
        acc[1][nt][e] = 0.f;
      }
  };
  // kGlu: a row tile's scaled sums wait in the CTA's slots for the other tile of their pair.
  float4* glu_slots = cluster_slots(xs, p.chunk_kt, m);
  const auto store = [&](int tile, const float (&y)[NT][4]) {
    if constexpr (kGlu) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        glu_slots[((tile - r0) * NT + nt) * 32 + lane] = make_float4(y[nt][0], y[nt][1], y[nt][2], y[nt][3]);
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = nt * 8 + 2 * t + (e & 1);
          const int row = tile * kTileN + g + 8 * (e >> 1);
          if (tok < m && row < n) {
            if (ws) ws[tok * n + row] = y[nt][e];
            else out[tok * n + row] = from_float<T>(y[nt][e]);
          }
        }
    }
  };
  // Under a norm prologue each token's rsqrt(mean(x^2) + eps), else 1: lane (g, t)'s tokens 8 nt + 2t + b.
  float token_scale[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int tok = nt * 8 + 2 * t + b;
      token_scale[nt][b] = 1.f;
      if constexpr (kPrologue) {
        if (p.prologue >= kPrologueNorm && tok < m) {
          float ss = 0.f;
          for (int w = 0; w < kGemvWarps; ++w) ss += warp_ss[w * kGemvMaxM + tok];
          token_scale[nt][b] = rsqrtf(ss / static_cast<float>(p.k) + p.eps);
        }
      }
    }
  const auto scale = [&](float (&y)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[nt][e] *= kPrologue ? rs[e >> 1] * token_scale[nt][e & 1] : rs[e >> 1];
  };

  bool waited = false;  // balanced cluster plans: cluster_wait done (send_row_tile)

  // Cluster plans: the scaled partials of this warp's (only) row tile. Balanced plans: the
  // unscaled sums of the warp's first segment where it starts inside its row tile (`sent_head`).
  float sent[NT][4];
  bool sent_head = false;
  bool from_start = kt_start == 0;  // the current segment began at the row tile's first K tile
  int rt = first_tile;
  int kt_rel = kt_start;
  for (int i = 0; i < items; i += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (i + d >= items) break;
      advance_load(buf[(d + kDepth - 1) % kDepth]);
      mma_tile<BITS, T, NT, kAbs, kOffsets>(buf[d], xs2 + kt_rel * 8 * m * 4, NT, g, t, table, lane_word, acc);
      if (++kt_rel == chunk) {
        if (!from_start) {
          take_sums(sent);  // a balanced plan's head segment: the first of this warp's, so at most one
          sent_head = true;
        } else if (!kBalancedCluster && p.cluster) {
          take_sums(sent);  // the warp's only row tile
          scale(sent);
        } else {
          float y[NT][4];  // not `sent`: that may hold the head segment of an earlier row tile
          take_sums(y);
          scale(y);
          if constexpr (kBalancedCluster)
            send_row_tile(cluster_slots(xs, p.chunk_kt, m), rt - r0, p.splits, split, lane, y, waited);
          else store(rt, y);
        }
        from_start = true;
        kt_rel = 0;
        rt += row_stride;
        load_row_scales(rt);
      }
    }
  }
  if (p.balanced) {
    // A segment that stops inside its row tile: begun at the tile's first K tile, this warp owns
    // the tile and adds the shares of the next warps that start inside it (their head segments),
    // in warp order; begun inside, it is such a head itself. The table is free once every warp
    // has left the main loop.
    const bool owner = items > 0 && kt_rel != 0 && from_start;
    if (items > 0 && kt_rel != 0 && !from_start) {
      take_sums(sent);
      sent_head = true;
    }
    float4* heads = reinterpret_cast<float4*>(table);  // [warp][nt][lane]
    __syncthreads();
    if (sent_head) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        heads[(warp * NT + nt) * 32 + lane] = make_float4(sent[nt][0], sent[nt][1], sent[nt][2], sent[nt][3]);
    }
    __syncthreads();
    if (owner) {
      float y[NT][4];
      take_sums(y);
      const int tile_end = (rt - r0 + 1) * chunk;
      for (int w = warp + 1; w < kGemvWarps && share_begin(w) < tile_end; ++w) {
        if (share_begin(w) == share_begin(w + 1)) continue;  // a warp without items
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float4 h = heads[(w * NT + nt) * 32 + lane];
          y[nt][0] += h.x;
          y[nt][1] += h.y;
          y[nt][2] += h.z;
          y[nt][3] += h.w;
        }
      }
      scale(y);
      if constexpr (kBalancedCluster)
        send_row_tile(cluster_slots(xs, p.chunk_kt, m), rt - r0, p.splits, split, lane, y, waited);
      else store(rt, y);
    }
    if constexpr (kGlu) {
      // silu(gate) * up of each pair of the range, rounded as the unfused ops round: the GEMV's output
      // to T, then silu_times. Lane ln's element e of pair r0 / 2 + j: rows and tokens as store's.
      __syncthreads();
      const int pairs = cta_items / chunk / 2, out_n = n / 2;
      for (int u = threadIdx.x; u < pairs * NT * 32; u += kGemvThreads) {
        const int j = u / (NT * 32), nt = u / 32 % NT, ln = u % 32;
        const float4 gv = glu_slots[(2 * j * NT + nt) * 32 + ln], uv = glu_slots[((2 * j + 1) * NT + nt) * 32 + ln];
        const float gate[4] = {gv.x, gv.y, gv.z, gv.w}, up[4] = {uv.x, uv.y, uv.z, uv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = nt * 8 + 2 * (ln & 3) + (e & 1);
          const int row = (r0 / 2 + j) * kTileN + (ln >> 2) + 8 * (e >> 1);
          if (tok < m && row < out_n) out[tok * out_n + row] = silu_times(from_float<T>(gate[e]), from_float<T>(up[e]));
        }
      }
    }
  }
  if constexpr (kBalancedCluster) {
    if (!waited) cluster_wait();
    cluster_arrive();
    cluster_wait();
    // Row tiles j % splits == split of the range: the splits' sums in split order (the order of
    // splitk_reduce_kernel: the same result bits).
    const int rows = cta_items / chunk;
    const float4* recv = cluster_slots(xs, p.chunk_kt, m);
    for (int j = split + warp * p.splits; j < rows; j += kGemvWarps * p.splits) {
      float y[NT][4] = {};
      for (int s = 0; s < p.splits; ++s) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float4 v = recv[((j - split + s) * NT + nt) * 32 + lane];
          y[nt][0] += v.x;
          y[nt][1] += v.y;
          y[nt][2] += v.z;
          y[nt][3] += v.w;
        }
      }
      store(r0 + j, y);
    }
  } else if (p.cluster) {
    // Split-K through distributed shared memory: the warp sends its partials to the slot
    // (warp / splits, split) of cluster CTA warp % splits, whose warp of the same index sums
    // the slots in split order (the order of splitk_reduce_kernel: the same result bits).
    float4* recv = cluster_slots(xs, p.chunk_kt, m);
    const int owner = warp % p.splits, slot0 = warp / p.splits * p.splits;
    cluster_wait();
    if (items > 0) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        st_cluster(recv + ((slot0 + split) * NT + nt) * 32 + lane, owner,
                   make_float4(sent[nt][0], sent[nt][1], sent[nt][2], sent[nt][3]));
    }
    cluster_arrive();
    cluster_wait();
    if (owner == split && items > 0) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        for (int s = 0; s < p.splits; ++s) {
          const float4 y = recv[((slot0 + s) * NT + nt) * 32 + lane];
          v[0] += y.x;
          v[1] += y.y;
          v[2] += y.z;
          v[3] += y.w;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = nt * 8 + 2 * t + (e & 1);
          const int row = first_tile * kTileN + g + 8 * (e >> 1);
          if (tok < m && row < n) out[tok * n + row] = from_float<T>(v[e]);
        }
      }
    }
  }
}

// Sum of the split-K partials ws [splits, mn] in split order, rounded once to the output dtype
// (the GEMV's and the GEMM's second kernel: deterministic, unlike atomics).
template <typename T>
__global__ void __launch_bounds__(256) splitk_reduce_kernel(const float* ws, T* out, int64_t mn, int splits) {
  wait_for_primary_grid();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= mn) return;
  float v = 0.f;
  for (int s = 0; s < splits; ++s) v += ws[s * mn + i];
  out[i] = from_float<T>(v);
}

template <typename T>
cudaError_t launch_splitk_reduce(const float* ws, void* out, int64_t mn, int splits, cudaStream_t stream) {
  const KernelLaunch launch(static_cast<unsigned>((mn + 255) / 256), 256, 0, stream, 1, device_has_pdl());
  return cudaLaunchKernelEx(&launch.config, splitk_reduce_kernel<T>, ws, static_cast<T*>(out), mn, splits);
}

template <int BITS, typename T, int NT, bool kAbs, bool kBalancedCluster, bool kPrologue, bool kRotate,
          bool kOffsets = false, bool kGlu = false>
cudaError_t launch_gemv_kernel(const MmParams& p, int grid, int cluster_slots, cudaStream_t stream) {
  constexpr auto kernel = gemv_kernel<BITS, T, NT, kAbs, kBalancedCluster, kPrologue, kRotate, kOffsets, kGlu>;
  const int smem = gemv_smem_bytes(static_cast<int>(p.m), p.chunk_kt, kAbs, cluster_slots);
  cudaError_t err = raise_smem_limit<kernel>(smem);
  if (err != cudaSuccess) return err;
  const KernelLaunch launch(static_cast<unsigned>(grid), kGemvThreads, smem, stream, p.cluster ? p.splits : 1,
                            use_pdl());
  return cudaLaunchKernelEx(&launch.config, kernel, p);
}

template <int BITS, typename T, int NT, bool kAbs, bool kPrologue, bool kRotate, bool kOffsets = false>
cudaError_t launch_gemv_table(const MmParams& p, int grid, cudaStream_t stream) {
  if (p.cluster && p.balanced) {
    const int ctas = grid / p.splits, n_tiles = static_cast<int>((p.n + kTileN - 1) / kTileN);
    const int rows = (n_tiles + ctas - 1) / ctas;  // a CTA's row tiles, at most
    return launch_gemv_kernel<BITS, T, NT, kAbs, true, kPrologue, kRotate, kOffsets>(
        p, grid, gemv_balanced_cluster_slots(p.splits, rows), stream);
  }
  cudaError_t err = launch_gemv_kernel<BITS, T, NT, kAbs, false, kPrologue, kRotate, kOffsets>(
      p, grid, p.cluster ? gemv_cluster_slots(p.splits) : 0, stream);
  if (err != cudaSuccess || p.splits == 1 || p.cluster) return err;
  return launch_splitk_reduce<T>(p.workspace, p.out, p.m * p.n, p.splits, stream);
}

// A prologue (MmParams::prologue) is its own instantiation: the plain GEMV keeps none of its code. kOffsets:
// block records (launch_gemv_offsets); the prologue touches only the x staging and the epilogue's token scale,
// the records only the weight's loads and decode, so the two flags combine freely.
template <int BITS, typename T, int NT, bool kAbs, bool kRotate, bool kOffsets = false>
cudaError_t launch_gemv_prologue(const MmParams& p, int grid, cudaStream_t stream) {
  return p.prologue == kPrologueNone
             ? launch_gemv_table<BITS, T, NT, kAbs, false, kRotate, kOffsets>(p, grid, stream)
             : launch_gemv_table<BITS, T, NT, kAbs, true, kRotate, kOffsets>(p, grid, stream);
}

// kRotate: the instantiation of rotated layers (p.rot_signs set), which stages x R; the host calls it
// only where the kernel table has it (generate_kernels.py) and its crossover says so, and otherwise
// rotates x with the standalone kernel first (kbit_api.cu, gemv_launch).
template <int BITS, typename T, int NT, bool kRotate>
cudaError_t launch_gemv(const MmParams& p, int grid, cudaStream_t stream) {
  // k = 5 keeps byte 3 of its permute source for the high bits: its cluster plans, whose
  // shared windows start at rank << 24, take relative table addressing.
  return p.abs_table && (BITS <= 4 || !p.cluster) ? launch_gemv_prologue<BITS, T, NT, true, kRotate>(p, grid, stream)
                     : launch_gemv_prologue<BITS, T, NT, false, kRotate>(p, grid, stream);
}

// Block records (p.block_scales int16, format.py): the GEMV with kOffsets, unrotated (no rotated layer holds
// records), with or without a prologue (generate_kernels.py builds it for the decode's token tiles; kbit_api.cu
// refuses the rest, and every other path dequantizes records: hf_kbit/backends/cuda.py).
// p.glu (glu_gemv_plan in kbit_api.cu): the kGlu instantiation, with a prologue, the table at its absolute
// address, balanced and one split: the decode's gate/up projection after its RMSNorm, where the plan is that.
template <int BITS, typename T, int NT>
cudaError_t launch_gemv_offsets(const MmParams& p, int grid, cudaStream_t stream) {
  if (p.rot_signs) return cudaErrorInvalidValue;
  if (p.glu) {
    if (!p.abs_table || !p.balanced || p.cluster || p.splits != 1 || p.prologue == kPrologueNone)
      return cudaErrorInvalidValue;
    return launch_gemv_kernel<BITS, T, NT, true, false, true, false, true, true>(p, grid, gemv_glu_slots(p.cta_rows),
                                                                                 stream);
  }
  return p.abs_table && (BITS <= 4 || !p.cluster)
             ? launch_gemv_prologue<BITS, T, NT, true, false, true>(p, grid, stream)
             : launch_gemv_prologue<BITS, T, NT, false, false, true>(p, grid, stream);
}

}  // namespace kbit
