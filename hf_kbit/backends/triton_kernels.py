"""Triton implementation for CUDA tensors of ``kbit::decode_attention`` (hf_kbit/_ops.py defines the op and its
reference; hf_kbit/attention.py plugs it into transformers as ``attn_implementation="kbit_decode"``), and the
launch helpers the Triton kernels share (programmatic dependent launch); the MoE layer's kernels are in
``triton_moe.py``.

Decode attention: one program per (batch, key/value head, slice of the keys) computes its query group's
softmax-weighted values with an online softmax in float32 (tensor-core dots), and a second kernel merges the
slices, one program per query row (deterministic); on sm_90+ both are programmatic dependent launches, as the
kbit GEMV is.
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
