"""Where a decode step's device time goes: its CUDA kernels grouped by origin (kbit, cuBLAS, Triton, attention),
each charged its exposed time, and the kbit modules that launch in one step, in call order."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from .report import format_table

if TYPE_CHECKING:
    from .timing import GreedyDecodeStep

# Kernel groups of the decode-step breakdown, by where a kernel comes from (its demangled name). First match
# wins: hf_kbit's own kernels (namespace kbit::, whose names may hold "gemv") before cuBLAS's, and inductor's
# Triton kernels (named after the ops they fuse, e.g. "..._scaled_dot_product_cudnn_attention_...") before
# the attention kernels proper (cuDNN's or flash SDPA, hf_kbit.attention's ``_decode_attention_*`` kernels).
KERNEL_GROUPS = (
    ("kbit", ("kbit::",)),
    ("cublas", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitkreduce", "cublas")),
    ("triton", ("triton",)),
    ("attention", ("sdpa", "flash", "fmha", "attention")),
)
KERNEL_GROUP_NAMES = tuple(g for g, _ in KERNEL_GROUPS) + ("other",)


def kernel_group(name: str) -> str:
    """The KERNEL_GROUPS group of a CUDA kernel name, or "other" (e.g. torch's own elementwise kernels)."""
    lowered = name.lower()
    for group, fragments in KERNEL_GROUPS:
        if any(f in lowered for f in fragments):
            return group
    return "other"


def _is_kbit_call_kernel(name: str) -> bool:
    """One per kbit::mm call: hf_kbit's GEMV or GEMM kernel, not a split-K reduce or the GEMM's x rewrite."""
    return "kbit::" in name and "reduce" not in name and "wgmma_x_kernel" not in name


def kernel_breakdown(
    kernels: list[tuple[str, float, float]], steps: int, top: int = 8, kbit_calls: list[str] | None = None
) -> dict[str, Any]:
    """Where ``steps`` decode steps' device time goes, from their kernels ((name, start, end) in microseconds,
    in start order, one stream: _profile_replay).

    Each kernel is charged its *exposed* time: from the end of the kernels before it (or from its own
    start, after an idle gap) to its own end. Under programmatic dependent launch a kernel starts before
    its predecessor ends and waits, so its duration counts time another kernel is charged; the exposed
    times and the idle gaps partition the profiled span. Returns per step: ``us_per_step`` (exposed, by
    kernel group, all groups, zeros included), ``kernel_us_per_step`` (durations, same groups),
    ``kernels_per_step``, ``idle_us_per_step``, ``total_us_per_step`` (the span: exposed + idle), ``top``
    (the ``top`` kernel names by exposed time, each with its group and microseconds per step) and
    ``kbit_us_by_module``: given ``kbit_calls`` (the kbit modules that launch in one step, in order:
    kbit_call_order), the mean exposed time of each module's GEMV/GEMM kernel, layers pooled
    ("model.layers.N.mlp.up_proj"), in call order; None without ``kbit_calls`` or when the kernels do not
    pair one to one with the calls.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    exposed, busy = dict.fromkeys(KERNEL_GROUP_NAMES, 0.0), dict.fromkeys(KERNEL_GROUP_NAMES, 0.0)
    count, by_name, calls = dict.fromkeys(KERNEL_GROUP_NAMES, 0), {}, []
    idle = 0.0
    done = kernels[0][1] if kernels else 0.0  # the end of the kernels so far
    for name, start, end in kernels:
        if end < start:
            raise ValueError(f"kernel {name!r} ends before it starts ({start} > {end})")
        group = kernel_group(name)
        idle += max(0.0, start - done)
        charged = max(0.0, end - max(done, start))
        done = max(done, end)
        exposed[group] += charged / steps
        busy[group] += (end - start) / steps
        count[group] += 1
        by_name[name] = by_name.get(name, 0.0) + charged / steps
        if _is_kbit_call_kernel(name):
            calls.append(charged)
    names = sorted(by_name, key=by_name.get, reverse=True)[:top]
    by_module = None
    if kbit_calls and len(calls) == steps * len(kbit_calls):
        pooled: dict[str, list[float]] = {}
        for i, t in enumerate(calls):
            pooled.setdefault(re.sub(r"\.\d+\.", ".N.", kbit_calls[i % len(kbit_calls)]), []).append(t)
        by_module = {module: sum(ts) / len(ts) for module, ts in pooled.items()}
    return {"us_per_step": exposed, "kernel_us_per_step": busy,
            "kernels_per_step": {g: n / steps for g, n in count.items()}, "idle_us_per_step": idle / steps,
            "total_us_per_step": sum(exposed.values()) + idle / steps,
            "top": [{"kernel": n, "group": kernel_group(n), "us_per_step": by_name[n]} for n in names],
            "kbit_us_by_module": by_module}


def kernel_breakdown_table(results: list[dict[str, Any]]) -> str:
    """Markdown table of the graph step's exposed microseconds per step by kernel group (kernel_breakdown), one
    row per result measured with a breakdown (``graph_kernel_breakdown``); "" when none was."""
    rows = []
    for r in results:
        split = r.get("graph_kernel_breakdown")
        if split:
            rows.append([r["variant"], r["batch"], f"{1000 * r['graph_step_ms']:.0f}",
                         f"{split['total_us_per_step']:.0f}",
                         *(f"{split['us_per_step'][g]:.0f}" for g in KERNEL_GROUP_NAMES),
                         f"{split['idle_us_per_step']:.0f}", f"{sum(split['kernels_per_step'].values()):.0f}"])
    headers = ["variant", "batch", "graph step us", "profiled us", *(f"{g} us" for g in KERNEL_GROUP_NAMES),
               "idle us", "kernels"]
    return format_table(headers, rows) if rows else ""


def kbit_module_summary(split: dict[str, Any]) -> str:
    """``kbit_us_by_module`` of a kernel_breakdown as text ("self_attn.q_proj 8.4, ..." exposed microseconds
    per call), or "" when it was not measured."""
    by_module = split.get("kbit_us_by_module") or {}
    layer_prefix = re.compile(r"^.*\.N\.")
    return ", ".join(f"{layer_prefix.sub('', module)} {us:.1f}" for module, us in by_module.items())


def kbit_call_order(step: GreedyDecodeStep) -> list[str]:
    """Names of the kbit modules that launch a kernel in one call of ``step``, in call order (forward hooks,
    one eager step; rewinds before and after): KbitLinear, or the KbitFusedProjections (``qkv_proj``) that
    serves its fused members."""
    import hf_kbit

    def launches(module) -> bool:
        if isinstance(module, hf_kbit.KbitLinear):
            return module.fused_into is None
        return isinstance(module, hf_kbit.nn.KbitFusedProjections)

    order: list[str] = []
    hooks = [module.register_forward_hook(lambda *_, name=name: order.append(name))
             for name, module in step.model.named_modules() if launches(module)]
    try:
        step.rewind()
        step()
    finally:
        for hook in hooks:
            hook.remove()
        step.rewind()
    return order
