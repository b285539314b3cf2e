"""Benchmark one MoE experts layer: KbitExperts vs transformers' default bf16 experts forward.

Both sides are the whole experts layer as a model calls it,
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``:

* **bf16**: the family's own fused experts module (``Qwen3MoeExperts``, ``Qwen3NextExperts``)
  taken from a one-layer model skeleton built from the published config, with the experts
  implementation transformers picks by default for such a model (``grouped_mm``:
  ``transformers.integrations.moe.grouped_mm_experts_forward``, whose matmuls are
  ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` on CUDA). One forward runs under a
  dispatch recorder first, and the ops it ran are written to the output; on CUDA the script
  stops if ``aten._grouped_mm`` is not among them.
* **kbit**: ``KbitExperts.from_experts`` of that module (random N(0, 0.02) bf16 weights,
  quantized to k bits), whose forward calls the public op ``torch.ops.kbit.grouped_mm``: the
  CUDA kernel when ``hf_kbit.backends.cuda`` registers one, else the PyTorch reference.

Routing: random router logits -> softmax -> top-k (renormalised when the config says
``norm_topk_prob``), fixed seed per T, the same for both sides.

``--block`` times the family's whole sparse MoE block instead, ``block(hidden_states [1, T, H])``: the router
(its matmul, softmax, top-k and renormalization) and the experts (and the shared expert where the family has
one), with N(0, 0.02) router weights routing N(0, 1) hidden states. bf16: the block as transformers builds it.
kbit: a copy quantized by ``hf_kbit.quantize_model`` (its experts a ``KbitExperts``, its router fused by
``hf_kbit.nn.routing``, a shared expert's Linears k-bit), as a kbit model holds them.

Cold L2 (DESIGN.md section 6): every timed call reads a different copy of the layer. A call
reads only its active experts, so the number of copies is chosen from the bytes the smallest T
reads: copies = max(2, ceil(400 MiB / bytes read per call)), at most 64 and ``--copy-mem-gb``. A
whole bf16 layer is already far larger than the L2 (Qwen3-30B-A3B: 1.2 GB; Qwen3-Next: 3.2 GB),
yet at T = 1 a call reads only 8-10 experts (63-75 MB), so several copies are still needed.
The output states the copies and the bytes they rotate through.

Timing: the calls (one per copy, at least 24) captured in one CUDA graph, replayed 7 times and
timed with events (median per call); when capture is impossible (the reference op reads the
routing offsets on the host) CUDA events over eager calls, recorded per cell. Ratio
``kN_x_bf16`` = bf16 time / kbit time (> 1: kbit is faster), both measured in the same run.

    python scripts/bench_moe.py --out benchmarks/results/h100_moe              # H100, bits 4
    python scripts/bench_moe.py --bits 2 3 4 5 --out benchmarks/results/h100_moe_k2-5
    python scripts/bench_moe.py --smoke --device cpu --out /tmp/moe_smoke     # CPU smoke run
    python scripts/bench_moe.py --tokens 512 1024 4096 8192 --gemm-kernel wgmma_ws --out benchmarks/results/h200_moe_ws
                                       # prefill on the warp-specialized GEMM's grouped calls
    python scripts/bench_moe.py --block --presets qwen3-30b-a3b --tokens 1 4 8 16 --out benchmarks/results/h200_moe_block
                                       # the whole sparse MoE block (router + experts) at decode
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import time_calls as graph_us  # noqa: E402  (the kernel benchmark's CUDA-graph timing)

from hf_kbit.eval import presets  # noqa: E402  (model presets)
from hf_kbit.backends.crossovers import GEMM_KERNELS  # noqa: E402
from hf_kbit.kernel_table import SUPPORTED_BITS  # noqa: E402

SCHEMA = "hf_kbit.bench_moe/1"

# Published config values (config.json of the Hub models; nothing is downloaded). Only one
# decoder layer is built, on the meta device; its experts module is materialized.
PRESETS: dict[str, dict[str, Any]] = {
    # The same published values as the decode benchmark (one source); make_config keeps one layer.
    "qwen3-30b-a3b": presets.PRESETS["qwen3-30b-a3b"],
    "qwen3-next": {
        "model_type": "qwen3_next",
        "title": "Qwen3-Next-80B-A3B / Qwen3-Coder-Next",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    },
    "tiny-qwen3-moe": {  # --smoke: small enough for the CPU reference; K = 40 is not a multiple of 32
        "model_type": "qwen3_moe",
        "title": "tiny Qwen3-MoE (smoke test)",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 40,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
}
REAL_PRESETS = ("qwen3-30b-a3b", "qwen3-next")
SMOKE_PRESET = "tiny-qwen3-moe"
TOKENS = (1, 4, 16, 64, 512)
SMOKE_TOKENS = (1, 3, 16)
BITS = SUPPORTED_BITS
DEFAULT_BITS = (4,)

L2_BYTES_H100 = 50 * 10**6
COLD_BYTES = 400 * 2**20  # bytes the rotation reads between two reads of one copy: 8x the H100's L2
MIN_CALLS = 24  # calls per CUDA graph (at least one per copy)
MAX_COPIES = 64  # enough for every real preset and k (k=2, T=1 on Qwen3-Next needs 45)
REPLAYS = 7
SEED = 0
WEIGHT_STD = 0.02  # the families' initializer_range
GROUPED_MM_OP = "aten._grouped_mm"
KBIT_OP = "kbit.grouped_mm"


# ---------------------------------------------------------------------------- building the layers


def make_config(preset: str):
    """One-layer transformers config of ``preset`` (published values, see PRESETS)."""
    from transformers import AutoConfig

    values = {k: v for k, v in PRESETS[preset].items() if k not in ("title", "num_hidden_layers")}
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, num_hidden_layers=1, **values)


def skeleton_experts(config, block: bool = False):
    """``(name, module)``: the family's experts module of layer 0 (``block``: the sparse MoE block holding it, its
    parent) on the meta device, from a model skeleton built the way ``from_pretrained`` builds it (so its config
    carries transformers' default experts implementation)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    name = next(n for n, _ in skeleton.named_modules() if n.endswith(".experts"))
    name = name.rpartition(".")[0] if block else name
    return name, skeleton.get_submodule(name)


def build_bf16_experts(config, device: str, seed: int = SEED, block: bool = False):
    """The experts module (``block``: the block holding it) of :func:`skeleton_experts`, materialized on
    ``device`` with N(0, WEIGHT_STD) bf16 weights."""
    import torch

    name, experts = skeleton_experts(config, block)
    experts = experts.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, WEIGHT_STD, generator=g)
    experts.requires_grad_(False)
    return name, experts.eval()


def routing(config, num_tokens: int, device: str, seed: int = SEED):
    """``(hidden_states [T, H] bf16, top_k_index [T, k], top_k_weights [T, k] bf16)`` from random
    router logits -> softmax -> top-k, as the family's router computes them."""
    import torch

    g = torch.Generator().manual_seed(seed * 100003 + num_tokens)
    x = torch.randn(num_tokens, config.hidden_size, generator=g).to(torch.bfloat16)
    logits = torch.randn(num_tokens, config.num_experts, generator=g)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, index = probs.topk(config.num_experts_per_tok, dim=-1)
    if getattr(config, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return x.to(device), index.to(device), weights.to(torch.bfloat16).to(device)


def block_input(config, num_tokens: int, device: str, seed: int = SEED):
    """``(hidden_states [1, T, H] bf16,)``, N(0, 1), the block's call; the same values as :func:`routing`'s."""
    return (routing(config, num_tokens, device, seed)[0][None],)


def make_kbit_block(bf16_block, bits: int):
    """A copy of ``bf16_block`` quantized as a kbit model holds it (``hf_kbit.quantize_model``, the defaults at
    ``bits``): its experts a KbitExperts, its router fused, any other Linear (a shared expert) a KbitLinear."""
    import hf_kbit

    return hf_kbit.quantize_model(copy.deepcopy(bf16_block), hf_kbit.KbitConfig(bits=bits), progress=False).eval()


def module_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def make_copies(module, count: int) -> list:
    """``count`` modules with their own weight storage (the first is ``module``). Made before any
    forward, so no per-module call cache is copied."""
    return [module] + [copy.deepcopy(module) for _ in range(count - 1)]


def copies_for(bytes_per_call: int, layer_bytes: int, mem_budget: int, cold: bool) -> int:
    """Copies so that the rotation reads >= COLD_BYTES between two reads of one copy, at least 2,
    at most MAX_COPIES and what fits in ``mem_budget``."""
    if not cold:
        return 1
    needed = min(MAX_COPIES, max(2, math.ceil(COLD_BYTES / max(bytes_per_call, 1))))
    fit = mem_budget // max(layer_bytes, 1)
    if fit < 2:
        raise MemoryError(
            f"two copies of the layer ({2 * layer_bytes / 2**30:.1f} GiB) do not fit --copy-mem-gb "
            f"{mem_budget / 2**30:.1f}; raise it or use --hot-l2"
        )
    return int(min(needed, fit))


# ---------------------------------------------------------------------------- what actually runs


class _OpRecorder:
    """Names of the ops (aten and custom) one forward dispatches, via a TorchDispatchMode."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.add(str(func.overloadpacket))  # e.g. "aten._grouped_mm", "kbit.grouped_mm"
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def recorded_ops(fn: Callable[[], Any]) -> list[str]:
    with _OpRecorder() as rec:
        fn()
    return sorted(rec.ops)


def describe_baseline(experts, ops: list[str]) -> dict:
    """Which bf16 experts forward transformers dispatches to, and what it ran."""
    import torch
    from transformers.integrations import moe

    impl = experts.config._experts_implementation
    forward = moe.ALL_EXPERTS_FUNCTIONS.get_interface(impl, type(experts).forward) if impl != "eager" else None
    forward_name = f"{forward.__module__}.{forward.__qualname__}" if forward is not None else "eager (per-expert loop)"
    if "transformers.grouped_mm_fallback" in ops:
        matmul = "transformers::grouped_mm_fallback (per-expert torch.mm loop, host sync)"
    elif GROUPED_MM_OP in ops:
        functional = hasattr(torch.nn.functional, "grouped_mm")
        matmul = "torch.nn.functional.grouped_mm" if functional else "torch._grouped_mm"
    else:
        matmul = "none of transformers' grouped_mm paths"
    return {
        "experts_class": f"{type(experts).__module__}.{type(experts).__qualname__}",
        "experts_implementation": impl,
        "forward": forward_name,
        "matmul": matmul,
        "observed_ops": ops,
        "is_grouped_mm_path": impl == "grouped_mm" and GROUPED_MM_OP in ops,
    }


def kbit_has_cuda_kernel() -> bool:
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key("kbit::grouped_mm", "CUDA")


# ---------------------------------------------------------------------------- timing


def _cuda_events():
    import torch

    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _eager_us(calls: list[Callable], replays: int, budget_s: float, cuda: bool) -> float:
    """Median microseconds per call over eager calls cycling through ``calls``: CUDA events on
    CUDA, the wall clock on CPU. As many calls as fit ``budget_s`` (at least 3, at most
    ``replays`` passes over ``calls``), in ``replays`` timed chunks."""
    import torch

    def timed(n: int, start: int) -> float:
        if cuda:
            e0, e1 = _cuda_events()
            e0.record()
            for i in range(n):
                calls[(start + i) % len(calls)]()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1) * 1e3
        t0 = time.perf_counter()
        for i in range(n):
            calls[(start + i) % len(calls)]()
        return (time.perf_counter() - t0) * 1e6

    if cuda:
        torch.cuda.synchronize()
    estimate = timed(1, 0)  # also the warm-up of copy 0
    total = int(min(max(3, budget_s * 1e6 / max(estimate, 1.0)), replays * len(calls)))
    chunk = max(1, total // replays)
    return statistics.median(timed(chunk, 1 + i * chunk) / chunk for i in range(max(1, total // chunk)))


def time_calls(calls: list[Callable], *, device: str, use_graph: bool, no_graph_reason: str, replays: int,
               budget_s: float) -> tuple[float, str]:
    """``(us per call, timing method)``: a CUDA graph when asked and capture works, else eager."""
    if device != "cuda":
        return _eager_us(calls, replays, budget_s, cuda=False), "wall_clock"
    if use_graph:
        try:
            return graph_us(calls, replays), "cuda_graph"
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back, and is recorded
            import torch

            torch.cuda.synchronize()
            no_graph_reason = f"graph capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return _eager_us(calls, replays, budget_s, cuda=True), f"events ({no_graph_reason})"


# ---------------------------------------------------------------------------- the benchmark


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def bench_preset(preset: str, tokens: list[int], bits_list: list[int], device: str, opts: dict,
                 log: Callable[[str], None]) -> tuple[dict, list[dict]]:
    import torch

    from hf_kbit.nn.experts import KbitExperts

    config = make_config(preset)
    block = opts.get("block", False)
    name, bf16 = build_bf16_experts(config, device, block=block)
    if block:
        inputs = {t: block_input(config, t, device) for t in tokens}
        with torch.inference_mode():
            active = {t: int(bf16.gate(inputs[t][0])[2].unique().numel()) for t in tokens}
    else:
        inputs = {t: routing(config, t, device) for t in tokens}
        active = {t: int(inputs[t][1].unique().numel()) for t in tokens}
    num_experts = config.num_experts
    info: dict[str, Any] = {
        "preset": preset, "title": PRESETS[preset]["title"], "model_type": config.model_type,
        "module": name, "block": block, "num_experts": num_experts, "top_k": config.num_experts_per_tok,
        "hidden_size": config.hidden_size, "moe_intermediate_size": config.moe_intermediate_size,
        "active_experts": {str(t): active[t] for t in tokens}, "variants": {},
    }
    rows = {t: {"preset": preset, "T": t, "active_experts": active[t]} for t in tokens}
    cuda = device == "cuda"
    graph_ok = cuda and not opts["no_graph"]

    def run_variant(label: str, master, use_graph: bool, no_graph_reason: str) -> dict:
        layer_bytes = module_bytes(master)
        per_expert = layer_bytes / num_experts
        read = {t: int(active[t] * per_expert) for t in tokens}
        count = 2 if opts["smoke"] else copies_for(min(read.values()), layer_bytes, opts["mem_budget"], opts["cold"])
        copies = make_copies(master, count)
        outputs = {}
        with torch.inference_mode():
            ops = recorded_ops(lambda: copies[0](*inputs[tokens[0]]))
            for t in tokens:
                outputs[t] = copies[0](*inputs[t]).float()
                calls = [lambda m=copies[i % count], a=inputs[t]: m(*a) for i in range(max(MIN_CALLS, count))]
                us, method = time_calls(calls, device=device, use_graph=use_graph, no_graph_reason=no_graph_reason,
                                        replays=opts["replays"], budget_s=opts["budget_s"])
                rows[t][f"{label}_us"] = us
                rows[t][f"{label}_timing"] = method
                log(f"{preset:15s} {label:5s} T={t:4d} active={active[t]:3d} {us:10.1f} us  [{method}]")
        del copies
        if cuda:
            torch.cuda.empty_cache()
        info["variants"][label] = {
            "layer_bytes": layer_bytes, "copies": count, "bytes_read_per_call": {str(t): read[t] for t in tokens},
            "rotation_bytes": {str(t): count * read[t] for t in tokens}, "observed_ops": ops,
        }
        return outputs

    bf16_out = run_variant("bf16", bf16, graph_ok, "--no-graph")
    baseline = describe_baseline(bf16.experts if block else bf16, info["variants"]["bf16"]["observed_ops"])
    info["bf16_baseline"] = baseline
    if cuda and not baseline["is_grouped_mm_path"]:
        raise RuntimeError(
            f"{preset}: the bf16 baseline did not run transformers' grouped_mm path "
            f"(experts_implementation={baseline['experts_implementation']!r}, ops {baseline['observed_ops']})"
        )

    kernel = kbit_has_cuda_kernel()
    no_graph = "--no-graph" if opts["no_graph"] else (
        "kbit::grouped_mm has no CUDA kernel: the PyTorch reference serves CUDA tensors with a host sync")
    for bits in bits_list:
        if block:
            kbit = make_kbit_block(bf16, bits)
        else:
            kbit = KbitExperts.from_experts(bf16, gate_up_bits=bits, down_bits=bits, name=name).eval()
        label = f"k{bits}"
        out = run_variant(label, kbit, graph_ok and kernel, no_graph)
        info["variants"][label]["op_has_cuda_kernel"] = kernel
        if KBIT_OP not in info["variants"][label]["observed_ops"]:
            raise RuntimeError(f"{preset}: KbitExperts did not call torch.ops.kbit.grouped_mm")
        for t in tokens:
            rows[t][f"{label}_x_bf16"] = rows[t]["bf16_us"] / rows[t][f"{label}_us"]
            rows[t][f"{label}_rel_err"] = _rel(out[t], bf16_out[t])
        del kbit
        if cuda:
            torch.cuda.empty_cache()
    del bf16
    return info, [rows[t] for t in tokens]


# ---------------------------------------------------------------------------- output


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


def _short(method: str) -> str:
    return {"cuda_graph": "graph", "wall_clock": "wall"}.get(method, "events")


def markdown(payload: dict) -> str:
    meta, bits_list = payload["meta"], payload["meta"]["bits"]
    lines = [
        (f"# MoE block (router + experts): kbit vs transformers bf16 — {meta['device']}" if meta.get("block") else
         f"# MoE experts layer: KbitExperts vs transformers bf16 — {meta['device']}"), "",
        f"Command: `{meta['command']}`  ",
        f"torch {meta['torch']}, transformers {meta['transformers']}, hf_kbit {meta['hf_kbit']}, "
        f"CUDA {meta['cuda']}, kbit CUDA library loaded: {meta['kbit_library']}, "
        f"`kbit::grouped_mm` CUDA kernel registered: {meta['kbit_grouped_mm_cuda_kernel']}.", "",
        ("Cells: microseconds per call of the whole sparse MoE block (router, experts; kbit: KbitExperts and the "
         "fused router), and " if meta.get("block") else
         "Cells: microseconds per call of the whole experts layer (forward with routing given), and ") +
        "bf16 time / kbit time in parentheses (> 1: kbit faster). `rel err`: ||y_kbit - y_bf16|| / "
        "||y_bf16|| of the same call (quantization noise, a sanity check).", "",
    ]
    if not meta["kbit_grouped_mm_cuda_kernel"] and meta["device_type"] == "cuda":
        lines += ["**The kbit column times the PyTorch reference of `kbit::grouped_mm` (no CUDA kernel "
                  "registered): not representative of the kernel.**", ""]
    for info in payload["presets"]:
        b = info["bf16_baseline"]
        lines += [f"## {info['title']} (`{info['preset']}`): {info['num_experts']} experts, top-{info['top_k']}, "
                  f"hidden {info['hidden_size']}, moe_intermediate {info['moe_intermediate_size']}", "",
                  f"bf16 baseline: `{b['experts_class']}` with experts_implementation=`{b['experts_implementation']}` "
                  f"(`{b['forward']}`, matmuls: `{b['matmul']}`; ops seen: {', '.join(b['observed_ops'])}).  "]
        for label, v in info["variants"].items():
            t_min = min(v["bytes_read_per_call"], key=int)
            lines.append(
                f"{label}: layer {_fmt_bytes(v['layer_bytes'])}, {v['copies']} copies; at T={t_min} a call reads "
                f"{_fmt_bytes(v['bytes_read_per_call'][t_min])}, the rotation {_fmt_bytes(v['rotation_bytes'][t_min])} "
                f"between two reads of one copy.  ")
        lines.append("")
        head = "| T | active experts | bf16 us | " + " | ".join(f"k={b} us (x bf16) | k={b} rel err" for b in bits_list)
        lines += [head + " | timing (bf16 / kbit) |", "|" + "---|" * (4 + 2 * len(bits_list))]
        for r in (r for r in payload["results"] if r["preset"] == info["preset"]):
            cells = [f"{r[f'k{b}_us']:.1f} ({r[f'k{b}_x_bf16']:.2f}x) | {r[f'k{b}_rel_err']:.3f}" for b in bits_list]
            timing = f"{_short(r['bf16_timing'])} / " + ", ".join(_short(r[f'k{b}_timing']) for b in bits_list)
            lead = f"| {r['T']} | {r['active_experts']} | {r['bf16_us']:.1f} | "
            lines.append(lead + " | ".join(cells) + f" | {timing} |")
        lines.append("")
    methods = sorted({r[k] for r in payload["results"] for k in r if k.endswith("_timing")})
    lines += ["Timing methods: " + "; ".join(f"`{m}`" for m in methods) + ".  ", meta["cold_l2"], ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="path prefix: writes PREFIX.json and PREFIX.md (default: print only)")
    ap.add_argument("--presets", nargs="+", default=None, choices=REAL_PRESETS, help="default: both")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help=f"T values (default {' '.join(map(str, TOKENS))})")
    ap.add_argument("--bits", type=int, nargs="+", default=list(DEFAULT_BITS), help="k values in 2..5 (default 4)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu (--smoke only)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"tiny {SMOKE_PRESET} layer, T in {SMOKE_TOKENS}: a quick run on CPU")
    ap.add_argument("--copy-mem-gb", type=float, default=None,
                    help="GPU memory for the weight copies of one variant (default: 40%% of the GPU's memory)")
    ap.add_argument("--hot-l2", action="store_true", help="one copy of the weights (hot L2; labelled in the output)")
    ap.add_argument("--no-graph", action="store_true", help="time eager calls with CUDA events, no CUDA graph")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds per cell for eager timing (default 3, smoke 0.2)")
    ap.add_argument("--block", action="store_true",
                    help="time the family's whole sparse MoE block (router + experts), kbit's router fused")
    ap.add_argument("--gemm-kernel", default=None, choices=GEMM_KERNELS,
                    help="CUDA: the GEMM kernel the planner takes (hf_kbit.backends.cuda.set_gemm_kernel); wgmma_ws "
                         "also serves the experts' grouped calls above the per-row threshold")
    args = ap.parse_args(argv)
    bad = [b for b in args.bits if b not in BITS]
    if bad:
        ap.error(f"--bits must be in {BITS}, got {bad}")
    if args.tokens is not None and any(t < 1 for t in args.tokens):
        ap.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.smoke and args.presets:
        ap.error("--smoke runs the tiny preset only; drop --presets")
    if args.gemm_kernel and args.device == "cpu":
        ap.error("--gemm-kernel needs a CUDA device (the CPU runs the reference)")
    return args


def run(args: argparse.Namespace, argv: list[str], log: Callable[[str], None] = print) -> dict:
    import torch
    import transformers

    import hf_kbit
    from hf_kbit import _lib

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA GPU is visible")
    if device == "cpu" and not args.smoke:
        raise ValueError("the real presets need a CUDA GPU (1.2-3.2 GB per bf16 layer copy); on CPU use --smoke")
    transformers.utils.logging.set_verbosity_error()
    if args.gemm_kernel:
        from hf_kbit.backends import cuda as backend

        backend.set_gemm_kernel(args.gemm_kernel)
    presets = [SMOKE_PRESET] if args.smoke else (args.presets or list(REAL_PRESETS))
    tokens = args.tokens or list(SMOKE_TOKENS if args.smoke else TOKENS)
    cold = not args.hot_l2
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        total = props.total_memory
        mem_budget = int(args.copy_mem_gb * 2**30) if args.copy_mem_gb else int(0.4 * total)
        device_name, l2 = torch.cuda.get_device_name(), getattr(props, "L2_cache_size", None)
    else:
        mem_budget, device_name, l2 = 0, f"CPU ({platform.processor() or platform.machine()})", None
    opts = {"mem_budget": mem_budget, "cold": cold, "smoke": args.smoke, "no_graph": args.no_graph, "block": args.block,
            "replays": 3 if args.smoke else REPLAYS,
            "budget_s": args.budget_s if args.budget_s is not None else (0.2 if args.smoke else 3.0)}
    if args.smoke:
        cold_text = "Smoke run: calls alternate between 2 weight copies (no cold-L2 claim)."
    elif cold:
        cold_text = (f"Cold L2: each timed call reads a different copy of the layer; copies = max(2, "
                     f"ceil({COLD_BYTES >> 20} MiB / bytes a call reads at the smallest T)), at most {MAX_COPIES} and "
                     f"{_fmt_bytes(mem_budget)} of copies per variant (the L2 is "
                     f"{_fmt_bytes(l2) if l2 else 'unknown'}; a whole bf16 layer exceeds it many times, but a "
                     "call reads only its active experts).")
    else:
        cold_text = "HOT L2 (--hot-l2): one copy of the weights, calls repeat on it; not a decoding-model number."
    log(f"device {device_name}; presets {presets}; T {tokens}; bits {args.bits}")

    infos, results = [], []
    for preset in presets:
        info, rows = bench_preset(preset, tokens, args.bits, device, opts, log)
        infos.append(info)
        results += rows
    meta = {
        "schema": SCHEMA,
        "command": "python scripts/bench_moe.py" + (" " + shlex.join(argv) if argv else ""),
        "device": device_name, "device_type": device, "torch": torch.__version__,
        "transformers": transformers.__version__, "hf_kbit": hf_kbit.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda if device == "cuda" else None, "kbit_library": _lib.available(),
        "kbit_grouped_mm_cuda_kernel": kbit_has_cuda_kernel(), "gemm_kernel": args.gemm_kernel, "bits": args.bits,
        "block": args.block,
        "tokens": tokens,
        "cold_l2": cold_text, "cold_l2_bytes": COLD_BYTES if cold and not args.smoke else None,
        "l2_bytes": l2, "copy_mem_budget_bytes": mem_budget or None, "hot_l2": not cold, "seed": SEED,
        "routing": ("the block's router (weights N(0, 0.02)) on hidden_states N(0,1); kbit: fused (hf_kbit.nn.routing)"
                    if args.block else "random router logits N(0,1) -> softmax -> top-k (renormalised when "
                    "norm_topk_prob), hidden_states N(0,1), weights N(0, 0.02), all bf16"),
        "ratio": "kN_x_bf16 = bf16_us / kN_us (> 1: kbit faster)",
    }
    payload = {"meta": meta, "presets": infos, "results": results}
    payload["markdown"] = markdown(payload)
    return payload


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    payload = run(args, argv, log=lambda line: print(line, flush=True))
    print(payload["markdown"])
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        md = payload.pop("markdown")
        Path(f"{out}.json").write_text(json.dumps(payload, indent=1) + "\n")
        Path(f"{out}.md").write_text(md)
        payload["markdown"] = md
        print(f"wrote {out}.json and {out}.md")
    return payload


if __name__ == "__main__":
    main()
