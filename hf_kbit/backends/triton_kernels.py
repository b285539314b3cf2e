"""Triton implementations for CUDA tensors of ``kbit::decode_attention``, the MoE routing ops
``kbit::softmax_topk``, ``kbit::sigmoid_group_topk`` and ``kbit::topk_softmax``, and the experts layer's
``kbit::silu_glu``, ``kbit::experts_combine`` and ``kbit::expert_offsets`` (hf_kbit/_ops.py defines the ops and
their references; hf_kbit/attention.py plugs the first into transformers as ``attn_implementation="kbit_decode"``,
hf_kbit/nn/routing.py the routing ops into the MoE routers, hf_kbit/nn/experts.py the others into ``KbitExperts``).

Decode attention: one program per (batch, key/value head, slice of the keys) computes its query group's
softmax-weighted values with an online softmax in float32 (tensor-core dots), and a second kernel merges the
slices, one program per query row (deterministic); on sm_90+ both are programmatic dependent launches, as the
kbit GEMV is. Routing: one program per token row, the family's rule after the router's matmul in one launch.
Experts layer: the SiLU gating between the two grouped products and the weighted sum of each token's experts,
one launch each (a program per row and block of columns); the grouping of rows by expert, one program (a sort of
the rows' keys and a histogram in registers).
Imported by ``hf_kbit.backends.load()`` only when Triton is installed.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .. import _ops
from .decode_attention import BLOCK_N, _padded_group, kernel_supports, plan_splits


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _pdl_supported(index: int) -> bool:
    """Programmatic dependent launch (griddepcontrol): sm_90 and later."""
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    # A programmatic dependent launch (sm_90+) starts while the kernel before it finishes: wait for that
    # kernel's grid (its writes included) before reading anything, then let the next kernel launch, so
    # its prologue overlaps this one. Triggering only after the wait keeps the kernels before this one
    # complete by the time the next one starts (inductor's PDL kernels read older buffers before their
    # own wait; the kbit GEMV reads only its weight).
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _decode_attention_slice_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, stats_ptr,
    q_sb, q_sh, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, m_sb, m_sn,
    kv_heads, kv_len, slice_len, qk_scale,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    DV: tl.constexpr, DV_P: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr, ONE_SLICE: tl.constexpr,
    PDL: tl.constexpr,
):
    # One (batch, key/value head, key slice): the group's rows of softmax(q k^T * scale + mask) v, as
    # float32 sums with their running max and denominator (log2 domain), or the normalized output
    # when the keys are not sliced. MASK: 0 none, 1 boolean (True attends), 2 additive. PDL: launched
    # as a programmatic dependent (_pdl_wait).
    _pdl_wait(PDL)
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    rows = tl.arange(0, GROUP_P)
    dq = tl.arange(0, D_P)
    dv = tl.arange(0, DV_P)
    row_ok = rows < GROUP
    q = tl.load(q_ptr + b * q_sb + (h * GROUP + rows)[:, None] * q_sh + dq[None, :],
                mask=row_ok[:, None] & (dq[None, :] < D), other=0.0)
    start = s * slice_len
    end = tl.minimum(start + slice_len, kv_len)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, DV_P], tl.float32)
    k_base = k_ptr + b * k_sb + h * k_sh
    v_base = v_ptr + b * v_sb + h * v_sh
    for n0 in range(start, end, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        live = cols < end
        if MASK == 1:
            live = live & (tl.load(mask_ptr + b * m_sb + cols * m_sn, mask=live, other=0) != 0)
        k = tl.load(k_base + cols[:, None] * k_sn + dq[None, :], mask=live[:, None] & (dq[None, :] < D),
                    other=0.0)
        scores = (tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32)  # a compiled call passes the scale as fp64
        if MASK == 2:
            add = tl.load(mask_ptr + b * m_sb + cols * m_sn, mask=live, other=0.0).to(tl.float32)
            scores += add * 1.4426950408889634
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing live yet stay at zero
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(scores - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * v_sn + dv[None, :], mask=live[:, None] & (dv[None, :] < DV),
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if ONE_SLICE:
        out = acc / l_i[:, None]
        tl.store(out_ptr + (b * kv_heads * GROUP + h * GROUP + rows)[:, None] * DV + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
    else:  # partials at [(batch, key/value head), slice, query row]
        slot = (bh * tl.num_programs(1) + s) * GROUP + rows
        tl.store(part_ptr + slot[:, None] * DV_P + dv[None, :], acc, mask=row_ok[:, None])
        tl.store(stats_ptr + slot * 2, m_i, mask=row_ok)
        tl.store(stats_ptr + slot * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _decode_attention_merge_kernel(part_ptr, stats_ptr, out_ptr, slices,
                                   GROUP: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
                                   SLICES_P: tl.constexpr, PDL: tl.constexpr):
    # One query row (batch, query head), all its slices at once: their sums rescaled to the common max
    # and added. The row's index is also its output row's.
    _pdl_wait(PDL)
    row = tl.program_id(0)
    bh = row // GROUP
    s = tl.arange(0, SLICES_P)
    dv = tl.arange(0, DV_P)
    live = s < slices
    slot = (bh * slices + s) * GROUP + row % GROUP
    m = tl.load(stats_ptr + slot * 2, mask=live, other=float("-inf"))
    w = tl.where(live, tl.exp2(m - tl.max(m, 0)), 0.0)
    l_sum = tl.sum(w * tl.load(stats_ptr + slot * 2 + 1, mask=live, other=0.0), 0)
    acc = tl.load(part_ptr + slot[:, None] * DV_P + dv[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / l_sum
    tl.store(out_ptr + row * DV + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


@torch.library.impl(_ops._lib, "decode_attention", "CUDA")
def _decode_attention_cuda(query, key, value, mask, scale, slices=0):
    """The op's Triton kernels where they take the tensors (kernel_supports), else the reference.

    Launched here rather than as a ``triton_op``, so that on sm_90+ they are programmatic dependent
    launches (inductor launches a ``triton_op``'s kernels without that attribute): each kernel's
    launch and setup overlap the kernel before it, and the next kernel's (the output projection's
    GEMV) overlap it."""
    group = query.shape[1] // key.shape[1]
    if not kernel_supports(query, key, value, mask, group):
        return _ops._decode_attention_ref(query, key, value, mask, scale)
    b, hq, _, d = query.shape
    hkv, n, dv = key.shape[1], key.shape[2], value.shape[-1]
    group = hq // hkv
    if slices <= 0:
        slices = plan_splits(b, hkv, n, _sm_count(query.device.index or 0))
    slice_len = math.ceil(math.ceil(n / slices) / BLOCK_N) * BLOCK_N
    slices = max(1, math.ceil(n / slice_len))
    group_p, dv_p = _padded_group(group), triton.next_power_of_2(dv)
    out = query.new_empty((b, 1, hq, dv))
    if mask is None:
        mask_kind, mask_arg, m_sb, m_sn = 0, query, 0, 0
    else:
        mask_kind = 1 if mask.dtype == torch.bool else 2
        mask_arg, m_sb, m_sn = mask, (mask.stride(0) if mask.shape[0] > 1 else 0), mask.stride(3)
    if slices == 1:
        part = stats = out  # not read: the one slice writes the output
    else:
        part = query.new_empty((b * hkv * slices * group, dv_p), dtype=torch.float32)
        stats = query.new_empty((b * hkv * slices * group, 2), dtype=torch.float32)
    pdl = _pdl_supported(query.device.index or 0)
    with torch.cuda.device(query.device):  # Triton launches on the current device's current stream
        _decode_attention_slice_kernel[(b * hkv, slices)](
            query, key, value, mask_arg, out, part, stats,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2), m_sb, m_sn,
            hkv, n, slice_len, scale * 1.4426950408889634,
            GROUP=group, GROUP_P=group_p, D=d, D_P=triton.next_power_of_2(d), DV=dv, DV_P=dv_p,
            BLOCK=BLOCK_N, MASK=mask_kind, ONE_SLICE=slices == 1, PDL=pdl, num_warps=4, launch_pdl=pdl,
        )
        if slices > 1:
            _decode_attention_merge_kernel[(b * hq,)](
                part, stats, out, slices, GROUP=group, DV=dv, DV_P=dv_p,
                SLICES_P=triton.next_power_of_2(slices), PDL=pdl, num_warps=4, launch_pdl=pdl,
            )
    return out


# ---------------------------------------------------------------------------- softmax_topk

# Experts a program holds in registers (Qwen3-Next has 512); above, the reference.
SOFTMAX_TOPK_MAX_EXPERTS = 1024


@triton.jit
def _top_k(x, offs, K: tl.constexpr, K_P: tl.constexpr):
    # K rounds of (largest x, its lowest index) over a row x at offs: float32 values and int64 indices [K_P],
    # slots from K on -inf and 0. Removed entries become -inf, so x needs K entries above -inf.
    slot = tl.arange(0, K_P)
    top = tl.full([K_P], float("-inf"), dtype=tl.float32)
    idx = tl.zeros([K_P], dtype=tl.int64)
    for r in tl.static_range(K):
        i = tl.argmax(x, 0, tie_break_left=True)
        top = tl.where(slot == r, tl.max(x, 0), top)
        idx = tl.where(slot == r, i.to(tl.int64), idx)
        x = tl.where(offs == i, float("-inf"), x)
    return top, idx


@triton.jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, indices_ptr, stride, experts,
                         K: tl.constexpr, K_P: tl.constexpr, BLOCK: tl.constexpr, RENORM: tl.constexpr,
                         PDL: tl.constexpr):
    # One token row: p = softmax(logits) in float32 (exp(x - max) / sum, as torch's softmax), then k rounds of
    # (largest p, its lowest index), then p / sum of the k when RENORM, stored in the weights' dtype.
    _pdl_wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    live = offs < experts
    x = tl.load(logits_ptr + row * stride + offs, mask=live, other=float("-inf")).to(tl.float32)
    e = tl.extra.cuda.libdevice.exp(x - tl.max(x, 0))
    top, idx = _top_k(tl.where(live, e / tl.sum(e, 0), float("-inf")), offs, K, K_P)
    slot = tl.arange(0, K_P)
    if RENORM:
        top = top / tl.sum(tl.where(slot < K, top, 0.0), 0)
    tl.store(weights_ptr + row * K + slot, top.to(weights_ptr.dtype.element_ty), mask=slot < K)
    tl.store(indices_ptr + row * K + slot, idx, mask=slot < K)


@torch.library.impl(_ops._lib, "softmax_topk", "CUDA")
def _softmax_topk_cuda(logits, k, renormalize, cast=False):
    """One Triton launch per call (the reference runs a softmax, a sort-based top-k, a sum, a division and a cast):
    a program per row. Equal probabilities go to the lower expert index first."""
    if logits.dim() != 2 or not 1 <= k <= logits.shape[-1] or logits.shape[-1] > SOFTMAX_TOPK_MAX_EXPERTS:
        return _ops._softmax_topk_ref(logits, k, renormalize, cast)
    experts = logits.shape[-1]
    return _route(_softmax_topk_kernel, logits, k, logits.dtype if cast else torch.float32, experts,
                  BLOCK=triton.next_power_of_2(experts), RENORM=renormalize)


def _route(kernel, logits, k: int, weights_dtype: torch.dtype, *args, **meta):
    """Launch a routing ``kernel`` (arguments: logits, weights, indices, the logits' row stride, ``args``; ``K``,
    ``K_P``, ``PDL`` and ``meta``), a program per row of ``logits [T, E]``: ``(weights [T, k], int64 indices)``."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows = logits.shape[0]
    weights = logits.new_empty((rows, k), dtype=weights_dtype)
    indices = logits.new_empty((rows, k), dtype=torch.int64)
    if rows:
        pdl = _pdl_supported(logits.device.index or 0)
        with torch.cuda.device(logits.device):
            kernel[(rows,)](logits, weights, indices, logits.stride(0), *args, K=k, K_P=triton.next_power_of_2(k),
                            PDL=pdl, num_warps=4, launch_pdl=pdl, **meta)
    return weights, indices


@triton.jit
def _sigmoid_group_topk_kernel(logits_ptr, weights_ptr, indices_ptr, stride, bias_ptr, groups, group_size, scale,
                               K: tl.constexpr, K_P: tl.constexpr, TOPK_GROUPS: tl.constexpr, G_P: tl.constexpr,
                               GS_P: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
    # One token row as a [group, expert in group] tile: s = sigmoid(logits) (1 / (1 + exp(-x)), correctly rounded),
    # c = s + bias; a group's score is the sum of its two largest c; TOPK_GROUPS rounds of (best group, lowest
    # index) keep groups; K rounds of (largest kept c, lowest expert index) pick the experts, whose s are the
    # weights, divided by their sum + 1e-20 when RENORM, times scale.
    _pdl_wait(PDL)
    row = tl.program_id(0)
    g = tl.arange(0, G_P)
    j = tl.arange(0, GS_P)
    live = (g[:, None] < groups) & (j[None, :] < group_size)
    expert = g[:, None] * group_size + j[None, :]
    x = tl.load(logits_ptr + row * stride + expert, mask=live, other=0.0).to(tl.float32)
    s = tl.div_rn(1.0, 1.0 + tl.extra.cuda.libdevice.exp(-x))
    c = tl.where(live, s + tl.load(bias_ptr + expert, mask=live, other=0.0).to(tl.float32), float("-inf"))
    best = tl.argmax(c, 1, tie_break_left=True)
    second = tl.max(tl.where(j[None, :] == best[:, None], float("-inf"), c), 1)
    group_score = tl.where(g < groups, tl.max(c, 1) + second, float("-inf"))
    kept = tl.zeros([G_P], dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        i = tl.argmax(group_score, 0, tie_break_left=True)
        kept = tl.where(g == i, 1, kept)
        group_score = tl.where(g == i, float("-inf"), group_score)
    c = tl.reshape(tl.where(kept[:, None] == 1, c, float("-inf")), [G_P * GS_P])
    s = tl.reshape(s, [G_P * GS_P])
    expert = tl.reshape(expert, [G_P * GS_P])
    pos = tl.arange(0, G_P * GS_P)
    slot = tl.arange(0, K_P)
    top = tl.zeros([K_P], dtype=tl.float32)
    idx = tl.zeros([K_P], dtype=tl.int64)
    for r in tl.static_range(K):
        p = tl.argmax(c, 0, tie_break_left=True)
        top = tl.where(slot == r, tl.sum(tl.where(pos == p, s, 0.0), 0), top)
        idx = tl.where(slot == r, tl.sum(tl.where(pos == p, expert, 0), 0).to(tl.int64), idx)
        c = tl.where(pos == p, float("-inf"), c)
    if RENORM:
        top = top / (tl.sum(tl.where(slot < K, top, 0.0), 0) + 1e-20)
    tl.store(weights_ptr + row * K + slot, top * scale, mask=slot < K)
    tl.store(indices_ptr + row * K + slot, idx, mask=slot < K)


@torch.library.impl(_ops._lib, "sigmoid_group_topk", "CUDA")
def _sigmoid_group_topk_cuda(logits, bias, k, groups, topk_groups, renormalize, scale):
    """One Triton launch per call (the reference: a sigmoid, two top-k, a mask built in five ops, a gather and the
    scaling): a program per row; float32 logits. Equal scores go to the lower group and expert index first."""
    _ops._check_router_logits("sigmoid_group_topk", logits, k, groups)
    experts = logits.shape[-1]
    group_size = experts // groups
    if (logits.dtype != torch.float32 or bias.shape != (experts,) or experts > SOFTMAX_TOPK_MAX_EXPERTS
            or group_size < 2 or not 1 <= topk_groups <= groups or k > topk_groups * group_size):
        return _ops._sigmoid_group_topk_ref(logits, bias, k, groups, topk_groups, renormalize, scale)
    return _route(_sigmoid_group_topk_kernel, logits, k, torch.float32, bias.contiguous(), groups, group_size,
                  float(scale), TOPK_GROUPS=topk_groups, G_P=max(2, triton.next_power_of_2(groups)),
                  GS_P=triton.next_power_of_2(group_size), RENORM=renormalize)


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, indices_ptr, stride, experts, K: tl.constexpr, K_P: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    # One token row: K rounds of (largest logit, lowest index), then the softmax over those K in float32
    # (exp(v - max) / sum, as torch's), stored in the logits' dtype.
    _pdl_wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride + offs, mask=offs < experts, other=float("-inf")).to(tl.float32)
    top, idx = _top_k(x, offs, K, K_P)
    slot = tl.arange(0, K_P)
    e = tl.where(slot < K, tl.extra.cuda.libdevice.exp(top - tl.max(top, 0)), 0.0)
    w = tl.div_rn(e, tl.zeros([K_P], dtype=tl.float32) + tl.sum(e, 0))
    tl.store(weights_ptr + row * K + slot, w.to(weights_ptr.dtype.element_ty), mask=slot < K)
    tl.store(indices_ptr + row * K + slot, idx, mask=slot < K)


@torch.library.impl(_ops._lib, "topk_softmax", "CUDA")
def _topk_softmax_cuda(logits, k):
    """One Triton launch per call (the reference: a sort-based top-k and a softmax): a program per row. Equal
    logits go to the lower expert index first."""
    _ops._check_router_logits("topk_softmax", logits, k)
    experts = logits.shape[-1]
    if experts > SOFTMAX_TOPK_MAX_EXPERTS or logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return _ops._topk_softmax_ref(logits, k)
    return _route(_topk_softmax_kernel, logits, k, logits.dtype, experts, BLOCK=triton.next_power_of_2(experts))


# ---------------------------------------------------------------------------- experts layer

# Elements a program of the experts layer's elementwise kernels covers (a row may take several programs).
EXPERTS_BLOCK = 1024


@triton.jit
def _silu_glu_kernel(gate_up_ptr, out_ptr, inter, in_stride, out_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # One row's block of silu(gate) * up, the roundings of the unfused ops: the SiLU (x / (1 + exp(-x)) in float32,
    # a correctly rounded division and libdevice's exp, as torch's kernel) rounded to the dtype, then the product.
    _pdl_wait(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < inter
    src = gate_up_ptr + row.to(tl.int64) * in_stride + offs
    g = tl.load(src, mask=live, other=0.0).to(tl.float32)
    u = tl.load(src + inter, mask=live, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    s = tl.div_rn(g, 1.0 + tl.extra.cuda.libdevice.exp(-g)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + offs, (s * u).to(dtype), mask=live)


@torch.library.impl(_ops._lib, "silu_glu", "CUDA")
def _silu_glu_cuda(gate_up):
    """One Triton launch (the reference: a SiLU and a product over the two strided halves)."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2 or gate_up.dtype not in (torch.float16, torch.bfloat16):
        return _ops._silu_glu_ref(gate_up)
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    if out.numel() == 0:
        return out
    pdl = _pdl_supported(gate_up.device.index or 0)
    with torch.cuda.device(gate_up.device):
        _silu_glu_kernel[(rows, triton.cdiv(inter, EXPERTS_BLOCK))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=EXPERTS_BLOCK, PDL=pdl, num_warps=4,
            launch_pdl=pdl,
        )
    return out


@triton.jit
def _experts_combine_kernel(y_ptr, ids_ptr, w_ptr, out_ptr, n, experts, y_stride, w_stride, out_stride,
                            K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # One token's block of sum_j w_j y[t k + j]: each weight zero for an id outside [0, experts), rounded to y's
    # dtype, the products summed in float32 in expert-slot order, rounded once.
    _pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        e = tl.load(ids_ptr + t * K + j)
        w = tl.load(w_ptr + t * w_stride + j)
        w = tl.where((e >= 0) & (e < experts), w, 0.0).to(dtype).to(tl.float32)
        y = tl.load(y_ptr + (t * K + j) * y_stride + offs, mask=live, other=0.0).to(tl.float32)
        acc += w * y
    tl.store(out_ptr + t * out_stride + offs, acc.to(dtype), mask=live)


@torch.library.impl(_ops._lib, "experts_combine", "CUDA")
def _experts_combine_cuda(y, expert_ids, weights, num_experts):
    """One Triton launch (the reference: a validity mask in three ops, a where, a cast and a batched matmul)."""
    _ops._check_combine(y, expert_ids, weights)
    if y.dtype not in (torch.float16, torch.bfloat16) or weights.dtype not in (torch.float32, y.dtype):
        return _ops._experts_combine_ref(y, expert_ids, weights, num_experts)
    y = y if y.stride(-1) == 1 else y.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    expert_ids = expert_ids.contiguous()
    num_tokens, top_k = weights.shape
    out = y.new_empty((num_tokens, y.shape[1]))
    if out.numel() == 0:
        return out
    pdl = _pdl_supported(y.device.index or 0)
    with torch.cuda.device(y.device):
        _experts_combine_kernel[(num_tokens, triton.cdiv(y.shape[1], EXPERTS_BLOCK))](
            y, expert_ids, weights, out, y.shape[1], num_experts, y.stride(0), weights.stride(0), out.stride(0),
            K=top_k, BLOCK=EXPERTS_BLOCK, PDL=pdl, num_warps=4, launch_pdl=pdl,
        )
    return out


# ---------------------------------------------------------------------------- expert_offsets

# Rows one program sorts in registers, and experts its histogram holds; above (prefill), the reference's sort.
EXPERT_OFFSETS_MAX_ROWS = 4096
EXPERT_OFFSETS_MAX_EXPERTS = 1024


@triton.jit
def _expert_offsets_kernel(ids_ptr, order_ptr, offsets_ptr, rows, experts,
                           BLOCK: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr):
    # Rows fall in groups: 0 (id < 0), 1 + id (an expert), E + 1 (id >= E); padding E + 2. One sort of the keys
    # group * BLOCK + row orders them by group and, within one, by row (stable); offsets[e] = rows of groups <= e
    # (the rows of ids < e), a histogram's running sum.
    _pdl_wait(PDL)
    row = tl.arange(0, BLOCK)
    live = row < rows
    ids = tl.load(ids_ptr + row, mask=live, other=0).to(tl.int64)
    group = tl.where(live, tl.minimum(tl.maximum(ids, -1), experts) + 1, experts + 2)
    keys = tl.sort(group * BLOCK + row)
    tl.store(order_ptr + row, keys % BLOCK, mask=live)
    ends = tl.cumsum(tl.histogram(group.to(tl.int32), BINS), 0)
    b = tl.arange(0, BINS)
    tl.store(offsets_ptr + b, ends.to(tl.int64), mask=b <= experts)


@torch.library.impl(_ops._lib, "expert_offsets", "CUDA")
def _expert_offsets_cuda(expert_ids, num_experts):
    """One Triton launch (the reference: a copy, an index fill, a sort, an arange and a search). Rows of no expert
    come out in row order at each end."""
    rows = expert_ids.shape[0] if expert_ids.dim() == 1 else -1
    if not 0 < rows <= EXPERT_OFFSETS_MAX_ROWS or not 0 < num_experts <= EXPERT_OFFSETS_MAX_EXPERTS:
        return _ops._expert_offsets_ref(expert_ids, num_experts)
    expert_ids = expert_ids.contiguous()
    order = expert_ids.new_empty((rows,), dtype=torch.int64)
    offsets = expert_ids.new_empty((num_experts + 1,), dtype=torch.int64)
    block = max(16, triton.next_power_of_2(rows))
    pdl = _pdl_supported(expert_ids.device.index or 0)
    with torch.cuda.device(expert_ids.device):
        _expert_offsets_kernel[(1,)](
            expert_ids, order, offsets, rows, num_experts, BLOCK=block,
            BINS=max(32, triton.next_power_of_2(num_experts + 3)), PDL=pdl, num_warps=8 if block >= 1024 else 4,
            launch_pdl=pdl,
        )
    return order, offsets
