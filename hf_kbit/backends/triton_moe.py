"""Triton implementations for CUDA tensors of the MoE layer's ops: the routing ops ``kbit::softmax_topk``,
``kbit::router_softmax_topk`` (the router's matmul too, at one token),
``kbit::sigmoid_group_topk`` and ``kbit::topk_softmax`` (hf_kbit/nn/routing.py plugs them into the routers), and
the experts layer's ``kbit::silu_glu``, ``kbit::experts_combine`` and ``kbit::expert_offsets``
(hf_kbit/nn/experts.py, ``KbitExperts``); hf_kbit/_ops.py defines the ops and their references.

Routing: one program per token row, the family's rule after the router's matmul in one launch; at one token
``router_softmax_topk`` takes the matmul into the same launch (the hidden dim split over programs, the last one to
finish applying the rule). Experts layer: the
SiLU gating between the two grouped products and the weighted sum of each token's experts, one launch each (a
program per row and block of columns); the grouping of rows by expert, one program (a sort of the rows' keys and a
histogram in registers). On sm_90+ every kernel is a programmatic dependent launch. Imported by
``hf_kbit.backends.load()`` only when Triton is installed.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from .. import _ops
from .triton_kernels import _pdl_supported, _pdl_wait


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
    _softmax_topk_row(logits_ptr + tl.program_id(0) * stride, weights_ptr, indices_ptr, tl.program_id(0), experts,
                      K, K_P, BLOCK, RENORM)


@triton.jit
def _softmax_topk_row(row_ptr, weights_ptr, indices_ptr, row, experts, K: tl.constexpr, K_P: tl.constexpr,
                      BLOCK: tl.constexpr, RENORM: tl.constexpr):
    # softmax_topk's rule on the logits at row_ptr, stored as row `row` of weights and indices. The fused router
    # runs it with the same BLOCK and warps, so its sums and maxima reduce in the same order: the same bits.
    offs = tl.arange(0, BLOCK)
    live = offs < experts
    x = tl.load(row_ptr + offs, mask=live, other=float("-inf")).to(tl.float32)
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
    _ops._check_router_logits("softmax_topk", logits, k)
    experts = logits.shape[-1]
    if experts > SOFTMAX_TOPK_MAX_EXPERTS:
        return _ops._softmax_topk_ref(logits, k, renormalize, cast)
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


# ---------------------------------------------------------------------------- router_softmax_topk

# Token rows and experts the fused router serves (decode at batch 1; Qwen3-Next has 512 experts); beyond, the
# router's matmul (cuBLAS) then softmax_topk's kernel. Its last program takes a row's sums and rule after the
# previous row's, a few microseconds each (H200, Qwen3-30B-A3B's router: 6.4 us fused against 8.9 at one row,
# 19.1 against 9.5 at four).
ROUTER_FUSED_MAX_ROWS = 1
ROUTER_FUSED_MAX_EXPERTS = 512
# Programs splitting the hidden dim (a power of 2), and the weight elements (experts x hidden columns) a program
# multiplies in one step.
ROUTER_PROGRAMS = 32
ROUTER_TILE_ELEMENTS = 8192
_ROUTER_ROWS_P = 16  # the rows' tile for tl.dot (at least 16)
# Arrival counters: one zeroed int32 array per device, made once, and a slot of it per stream that calls the
# fused router (calls on one stream run one after another; two streams must not share a counter). Streams beyond
# the slots take the unfused path.
ROUTER_COUNTER_SLOTS = 64
_router_counters: dict[int, torch.Tensor] = {}  # by device index
_router_slots: dict[tuple[int, int], torch.Tensor] = {}  # by (device index, stream): a slot of the device's array


@triton.jit
def _router_softmax_topk_kernel(x_ptr, w_ptr, partial_ptr, counter_ptr, logits_ptr, weights_ptr, indices_ptr,
                                rows, hidden, experts, x_stride, w_stride, span,
                                K: tl.constexpr, K_P: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
                                BLOCK_H: tl.constexpr, ROWS_P: tl.constexpr, PROGRAMS: tl.constexpr,
                                RENORM: tl.constexpr, PDL: tl.constexpr):
    # Program p: the rows' partial logits over hidden columns [p span, (p + 1) span), float32 on the tensor
    # cores, into partial[p]. The program that arrives last (a counter it then resets) sums the PROGRAMS partials
    # of a row as one tile (a fixed order), rounds the logits to their dtype (what F.linear returns) and stores
    # them, then runs softmax_topk's rule on each stored row as softmax_topk's kernel does.
    _pdl_wait(PDL)
    pid = tl.program_id(0)
    r = tl.arange(0, ROWS_P)
    e = tl.arange(0, BLOCK_E)
    hh = tl.arange(0, BLOCK_H)
    acc = tl.zeros([ROWS_P, BLOCK_E], dtype=tl.float32)
    for step in range(0, span, BLOCK_H):  # columns past `hidden` load as zeros
        h = pid * span + step + hh
        xt = tl.load(x_ptr + r[:, None] * x_stride + h[None, :], mask=(r[:, None] < rows) & (h[None, :] < hidden),
                     other=0.0)
        wt = tl.load(w_ptr + e[:, None] * w_stride + h[None, :],
                     mask=(e[:, None] < experts) & (h[None, :] < hidden), other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc)
    tl.store(partial_ptr + (pid * ROWS_P + r[:, None]) * BLOCK_E + e[None, :], acc)
    tl.debug_barrier()  # every thread's partial is stored before the counter says so
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == PROGRAMS - 1:
        p = tl.arange(0, PROGRAMS)
        for row in range(rows):
            part = tl.load(partial_ptr + (p[:, None] * ROWS_P + row) * BLOCK_E + e[None, :], cache_modifier=".cg")
            tl.store(logits_ptr + row * experts + e, tl.sum(part, 0).to(logits_ptr.dtype.element_ty),
                     mask=e < experts)
        tl.debug_barrier()  # the logits are stored before the rule reads them back
        for row in range(rows):
            _softmax_topk_row(logits_ptr + row * experts, weights_ptr, indices_ptr, row, experts, K, K_P, BLOCK,
                              RENORM)
        tl.atomic_xchg(counter_ptr, 0)


def _router_counter(device: torch.device) -> torch.Tensor | None:
    """The fused router's arrival counter for the current stream of ``device`` (a slot of the device's array),
    zero between calls: the last program of a call resets it. None where no counter can be had: the device's array
    is not made yet and the stream is capturing a CUDA graph (zeroing it there would be a step of the graph), or
    every slot is taken."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    counter = _router_slots.get(key)
    if counter is not None:
        return counter
    counters = _router_counters.get(index)
    if counters is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        counters = _router_counters[index] = _zeros_outside_graph_pools(index, ROUTER_COUNTER_SLOTS)
    slot = sum(1 for device_index, _ in _router_slots if device_index == index)
    if slot == ROUTER_COUNTER_SLOTS:
        return None
    counter = _router_slots[key] = counters[slot:slot + 1]
    return counter


def _zeros_outside_graph_pools(index: int, size: int) -> torch.Tensor:
    """``torch.zeros(size, int32)`` on CUDA device ``index``, allocated by a thread of its own. A CUDA graph's
    memory pool (torch.compile's CUDA graphs warming up or recording, ``torch.cuda.graph``) takes the allocations
    of the thread that opened it; a tensor that outlives the graph's run must not live there (cudagraph trees
    refuse a live tensor of the pool that no output owns, and the pool may hand its memory to another tensor)."""
    made: list = []

    def make():
        try:
            with torch.cuda.device(index):
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    made.append(torch.zeros(size, dtype=torch.int32, device=f"cuda:{index}"))
                stream.synchronize()
        except BaseException as error:  # re-raised in the caller's thread
            made.append(error)

    thread = threading.Thread(target=make, name="kbit-router-counters")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


@torch.library.impl(_ops._lib, "router_softmax_topk", "CUDA")
def _router_softmax_topk_cuda(x, weight, k, renormalize, cast=False):
    """Up to ROUTER_FUSED_MAX_ROWS rows of 16-bit x and ROUTER_FUSED_MAX_EXPERTS experts: the router's matmul and
    softmax_topk's rule in one launch, the hidden dim split over ROUTER_PROGRAMS programs (float32 sums rounded once
    to x's dtype, as F.linear returns them; cuBLAS may sum in another order, or in bf16). Otherwise, or where no
    arrival counter can be had (:func:`_router_counter`), the router's matmul, then softmax_topk's kernel."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        return _ops._router_softmax_topk_ref(x, weight, k, renormalize, cast)  # raises its error
    rows, hidden = x.shape
    experts = weight.shape[0]
    fused = (1 <= rows <= ROUTER_FUSED_MAX_ROWS and experts <= ROUTER_FUSED_MAX_EXPERTS
             and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.device == x.device)
    if fused and not 1 <= k <= experts:
        raise ValueError(f"router_softmax_topk: k must be in 1..{experts} (the experts), got {k}")
    counter = _router_counter(x.device) if fused else None
    if counter is None:
        logits = torch.nn.functional.linear(x, weight)
        return (logits, *_softmax_topk_cuda(logits, k, renormalize, cast))
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    block = triton.next_power_of_2(experts)
    block_e = max(16, block)
    block_h = max(16, min(128, ROUTER_TILE_ELEMENTS // block_e))
    span = triton.cdiv(triton.cdiv(hidden, ROUTER_PROGRAMS), block_h) * block_h
    partial = torch.empty((ROUTER_PROGRAMS, _ROUTER_ROWS_P, block_e), dtype=torch.float32, device=x.device)
    logits = x.new_empty((rows, experts))
    weights = x.new_empty((rows, k), dtype=x.dtype if cast else torch.float32)
    indices = x.new_empty((rows, k), dtype=torch.int64)
    pdl = _pdl_supported(x.device.index or 0)
    with torch.cuda.device(x.device):
        _router_softmax_topk_kernel[(ROUTER_PROGRAMS,)](
            x, weight, partial, counter, logits, weights, indices, rows, hidden, experts, x.stride(0),
            weight.stride(0), span, K=k, K_P=triton.next_power_of_2(k), BLOCK=block, BLOCK_E=block_e,
            BLOCK_H=block_h, ROWS_P=_ROUTER_ROWS_P, PROGRAMS=ROUTER_PROGRAMS, RENORM=renormalize, PDL=pdl,
            num_warps=4, launch_pdl=pdl)
    return logits, weights, indices


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
