"""The decode benchmark behind ``scripts/bench_generate.py``: bf16 and kbit variants of a preset model
(hf_kbit.eval.presets) measured under one set of settings, ``generate()`` (hf_kbit.eval.timing), the graph step
(hf_kbit.eval.graph_step) and the decode loop side by side, host and device time per token apart, speedups
against bf16 of the same run, the issues' acceptance bars, a stopped run resumed, the markdown table. The
script's docstring says what each number means."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .graph_step import measure_graph_step
from ..rotation_policy import check_rotation
from .models import check_attention, dtype_name
from .presets import PRESETS, build_model, make_config
from .report import format_table
from .timing import measure_decode_loop, measure_speed
from .variants import kbit_summary

SCHEMA = "hf_kbit.bench_generate/1"
# Issue 36's bars beside generate()'s speed-up: kbit's host time per token at most this multiple of bf16's,
# and (Llama-3-8B, LM head in bf16) the graph step at least this many times bf16's.
ISSUE36_HOST_TIME_MAX = 1.1
ISSUE36_GRAPH_STEP_MIN = 2.6


def unquantized_expert_params(model) -> int:
    """Elements of 3-D expert weights still in full precision (MoE models whose experts kbit did not convert)."""
    return sum(p.numel() for name, p in model.named_parameters() if p.dim() == 3 and ".experts." in f".{name}")


def quantize(model, bits: int, lm_head: bool = False, fuse_projections: bool = True, fusion_pass: bool = True,
             rotation: bool | str = False, block_offsets: bool | None = None, decode_attention: bool = True):
    import hf_kbit

    skip = [] if lm_head else ["lm_head"]
    config = hf_kbit.KbitConfig(bits=bits, fuse_projections=fuse_projections, fusion_pass=fusion_pass,
                                rotation=rotation, block_offsets=block_offsets, decode_attention=decode_attention)
    return hf_kbit.quantize_model(model, config, modules_to_not_convert=skip)


def reset_compiled(model=None) -> None:
    """Forget compiled graphs between variants, so no variant runs into dynamo's recompile limit, and inductor's
    CUDA graph trees (generate()'s and the decode loop's), which keep their memory pool and recorded graphs until
    reset; then collect the garbage that referred to them."""
    import gc

    import torch

    torch._dynamo.reset()
    if torch.cuda.is_available():
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()  # torch's reset() does this itself only in later versions
    gc.collect()
    if model is not None and hasattr(model, "_compiled_call"):
        del model._compiled_call  # not None: transformers compiles anew only where the attribute is absent


def settings(
    preset: str,
    variants: list[str],
    device: str,
    dtype,
    *,
    layers: int | None = None,
    batch_sizes: tuple[int, ...] = (1, 8),
    prompt_len: int = 128,
    new_tokens: int = 128,
    repeats: int = 3,
    static_compile: bool | None = None,
    graph_step: bool = True,
    steps_per_graph: int = 16,
    decode_loop: bool = True,
    quantize_lm_head: bool = False,
    kernel_breakdown: bool = False,
    fuse_projections: bool = True,
    fusion_pass: bool | None = None,
    attention: str = "default",
    rotation: bool | str = False,
    block_offsets: bool | None = None,
) -> dict[str, Any]:
    """What a run measures, and under which settings, as its JSON records it (all but the results): what
    ``run`` measures under and ``--resume`` compares. ValueError for settings that cannot run together."""
    import torch._inductor.config as inductor_config

    from hf_kbit import KbitConfig, fusion

    cuda = device.startswith("cuda")
    if graph_step and steps_per_graph < 1:
        raise ValueError(f"--steps-per-graph must be >= 1, got {steps_per_graph}")
    if kernel_breakdown and not (graph_step and cuda):
        raise ValueError(f"--kernel-breakdown profiles the graph step's CUDA kernels: it needs a CUDA device and "
                         f"the graph step, got device {device!r}, graph step {'on' if graph_step else 'off'}")
    static_compile = cuda if static_compile is None else static_compile
    if fusion_pass and not (cuda and (graph_step or decode_loop or static_compile)):
        raise ValueError(f"--fusion-pass rewrites the compiled decode step: it needs a CUDA device and the graph step, "
                         f"the decode loop or generate()'s compile, got device {device!r}, graph step "
                         f"{'on' if graph_step else 'off'}, decode loop {'on' if decode_loop else 'off'}, "
                         f"compile {'on' if static_compile else 'off'}")
    check_attention(attention)
    check_rotation(rotation, "rotation")
    config = make_config(preset, layers)
    return {
        "schema": SCHEMA,
        "preset": preset,
        "model": PRESETS[preset]["title"],
        "layers": config.num_hidden_layers,
        "layers_full": PRESETS[preset]["num_hidden_layers"],
        "random_weights": True,
        "variants": list(variants),
        "device": device,
        "compute_dtype": dtype_name(dtype),
        "static_cache_and_compile": static_compile,
        "lm_head_quantized": quantize_lm_head,
        "fused_projections": fuse_projections,  # q/k/v and gate/up as one kbit launch each
        # hf_kbit.fusion's compile (pass, combo kernels, PDL on sm_90+) in the compiled decode steps (generate()'s,
        # the graph step's, the loop's): True every variant, False none, None kbit variants (each row says)
        "fusion_pass": fusion_pass,
        # inductor's combo kernels, which hf_kbit.fusion's compile options turn on, where it is used
        "combo_kernels": fusion.compile_options().get("combo_kernels", False) and fusion_pass is not False,
        # "default": each variant's own (bf16: transformers' sdpa; kbit: KbitConfig.decode_attention's kbit_decode);
        # else the transformers attention implementation of every variant. Each row records its own.
        "attention": attention,
        "rotation": rotation,  # KbitConfig.rotation of the kbit variants (format v3: weights stored rotated along K)
        # KbitConfig.block_offsets of the kbit variants as quantization settles it (format v4: block records)
        "block_offsets": KbitConfig(rotation=rotation, block_offsets=block_offsets).resolved_block_offsets(),
        # TORCHINDUCTOR_ENABLE_PDL=1: inductor's Triton kernels launch as programmatic dependents (None: no such config)
        "inductor_pdl": getattr(inductor_config.triton, "enable_pdl", None),
        "graph_step": None if not graph_step else {
            "timing": "cuda_graph_events" if cuda else "eager_wall_clock",
            "submission_hidden": cuda,  # replays start on a busy GPU (hf_kbit.eval.graph_step)
            "compiled": cuda,
            "steps_per_graph": min(steps_per_graph, new_tokens),
            "kernel_breakdown": kernel_breakdown,
        },
        "decode_loop": None if not decode_loop else {
            "timing": "wall_clock",
            "compiled": cuda,  # fullgraph, inductor's CUDA graphs (generate()'s compile of the decode step)
            "steps": new_tokens - 1,
        },
        "setup": {"prompt_len": prompt_len, "new_tokens": new_tokens, "batch_sizes": list(batch_sizes),
                  "repeats": repeats},
    }


def variant_bits(bits_list: list[int], include_bf16: bool = True) -> list[int | None]:
    """The variants a run measures, in order, as their bits (None: bf16)."""
    return ([None] if include_bf16 else []) + list(bits_list)


def variant_name(bits: int | None) -> str:
    return "bf16" if bits is None else f"kbit{bits}"


def resumable_results(path: str | Path, expected: dict[str, Any], gpu: str | None) -> list[dict[str, Any]]:
    """The result rows of the stopped run in ``path``, after checking it was measured under ``expected``
    (``settings``) on a GPU of the name ``gpu`` (None: none); ValueError naming what does not match."""
    import json

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--resume: {path} does not exist; run without --resume to start a new run there")
    earlier = json.loads(path.read_text(encoding="utf-8"))
    if earlier.get("complete", True):
        raise ValueError(f"--resume: {path} holds a complete run, nothing to resume; "
                         f"delete it or give another --out to measure again")
    for key, value in {**expected, "gpu": gpu}.items():
        found = earlier.get("environment", {}).get("gpu") if key == "gpu" else earlier.get(key)
        if found != value:
            raise ValueError(f"--resume: {path} was measured with {key} = {found!r}, "
                             f"this run has {key} = {value!r}; resume with the same arguments and environment")
    return earlier["results"]


def run(
    preset: str,
    bits_list: list[int],
    device: str,
    dtype,
    include_bf16: bool = True,
    kept: list[dict[str, Any]] | None = None,
    on_variant=None,
    log=print,
    **options,
) -> dict[str, Any]:
    """Measure bf16 (unless ``include_bf16`` is False) and each kbit width under ``options`` (the keywords
    of ``settings``: layers, batch sizes, lengths, repeats, compile, graph step, LM head, fusion); the
    payload, with ``complete`` True. ``kept``: result rows of an earlier run under the same settings
    (``resumable_results``), whose variants are not measured again. ``on_variant(payload)``: called
    after each variant is measured, with the payload so far (``complete`` False until the last)."""
    import torch

    variants = variant_bits(bits_list, include_bf16)
    head = settings(preset, [variant_name(b) for b in variants], device, dtype, **options)
    setup, graph = head["setup"], head["graph_step"]
    prompt_len, new_tokens, repeats = setup["prompt_len"], setup["new_tokens"], setup["repeats"]
    config = make_config(preset, head["layers"])
    static_compile = head["static_cache_and_compile"]
    kept_rows: dict[str, list[dict[str, Any]]] = {}
    for row in kept or []:
        kept_rows.setdefault(row["variant"], []).append(row)
    results: list[dict[str, Any]] = []
    resumed: list[str] = []

    def payload(complete: bool) -> dict[str, Any]:
        add_speedups(results)
        out = {**head, "complete": complete, "resumed_variants": resumed, "results": results}
        out["checks"] = acceptance(out)
        return out

    for index, bits in enumerate(variants):
        variant = variant_name(bits)
        if variant in kept_rows:
            results.extend(kept_rows[variant])
            resumed.append(variant)
            log(f"{variant:>6}: kept from the earlier run")
            continue
        reset_compiled()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            log(f"{variant:>6}: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated before the build")
        start = time.perf_counter()
        model = build_model(config, device, dtype, attention=head["attention"])
        info: dict[str, Any] = {"variant": variant, "bits": bits}
        if bits is None:
            info.update({"bits_per_weight": 16.0, "quantized_fraction": 0.0})
        else:
            model = quantize(model, bits, lm_head=head["lm_head_quantized"], fuse_projections=head["fused_projections"],
                             fusion_pass=head["fusion_pass"] is not False, rotation=head["rotation"],
                             block_offsets=head["block_offsets"], decode_attention=head["attention"] != "sdpa")
            info.update(kbit_summary(model))
        # as this variant's generate() compiles by default (kbit: KbitConfig.fusion_pass), unless told otherwise
        fusion_pass = head["fusion_pass"] if head["fusion_pass"] is not None else bits is not None
        fusion_pass = fusion_pass and device.startswith("cuda")  # on CPU nothing compiles
        info.update({"fusion_pass": fusion_pass, "combo_kernels": fusion_pass and head["combo_kernels"]})
        info["unquantized_expert_params"] = unquantized_expert_params(model) if bits is not None else None
        info["attention"] = model.config._attn_implementation
        info["setup_seconds"] = round(time.perf_counter() - start, 1)
        rows = []
        for batch in setup["batch_sizes"]:
            s = measure_speed(model, batch, prompt_len, new_tokens, device, static_compile, repeats,
                              fusion_pass=fusion_pass)
            rows.append({**info, **s})
            log(f"{variant:>6} batch {batch}: decode {s['decode_tok_s']:.1f} tok/s "
                f"({s['ms_per_decode_step']:.2f} ms/step, median {s['token_ms_median']:.2f}), "
                f"prefill {s['prefill_tok_s']:.0f} tok/s, compiled={s['compiled']}")
        if device.startswith("cuda"):  # generate()'s peak, before the graph step allocates its own cache
            for r in rows:
                r["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        for r in rows:
            keys = ("graph_step_ms", "graph_decode_tok_s", "graph_replay_tokens_match", "graph_kernel_breakdown")
            g = dict.fromkeys(keys)
            if graph:
                g = measure_graph_step(
                    model, r["batch"], prompt_len, new_tokens, device, repeats, graph["steps_per_graph"],
                    breakdown=graph["kernel_breakdown"], fusion_pass=fusion_pass,
                )
                log(f"{variant:>6} batch {r['batch']}: graph step {g['graph_step_ms']:.2f} ms "
                    f"({g['graph_decode_tok_s']:.1f} tok/s), {g['graph_steps']} steps per replay")
            r.update({key: g[key] for key in keys})
            keys = ("loop_step_ms", "loop_decode_tok_s", "loop_tokens_argmax_match")
            loop = dict.fromkeys(keys)
            if head["decode_loop"]:
                reset_compiled(model)  # the loop compiles the forward once more: stay clear of the recompile limit
                loop = measure_decode_loop(model, r["batch"], prompt_len, new_tokens, device, repeats,
                                           fusion_pass=fusion_pass)
                log(f"{variant:>6} batch {r['batch']}: decode loop {loop['loop_step_ms']:.2f} ms "
                    f"({loop['loop_decode_tok_s']:.1f} tok/s), tokens at the eager argmax "
                    f"{loop['loop_tokens_argmax_match']:.0%}")
            r.update({key: loop[key] for key in keys})
            r.update(host_and_device(r))
        results.extend(rows)
        reset_compiled(model)
        del model
        if on_variant is not None and index < len(variants) - 1:
            on_variant(payload(complete=False))
    return payload(complete=True)


def host_and_device(row: dict[str, Any]) -> dict[str, float | None]:
    """A row's time per token split (see the module doc): device = the graph step, host = generate()'s median
    token interval minus it, loop host = the decode loop's step minus it (None where not measured)."""
    device_ms = row.get("graph_step_ms")
    if device_ms is None:
        return {"device_ms_per_token": None, "host_ms_per_token": None, "loop_host_ms_per_token": None}
    loop = row.get("loop_step_ms")
    return {"device_ms_per_token": device_ms, "host_ms_per_token": row["token_ms_median"] - device_ms,
            "loop_host_ms_per_token": loop - device_ms if loop is not None else None}


def add_speedups(results: list[dict[str, Any]]) -> None:
    base = {r["batch"]: r for r in results if r["bits"] is None}
    for r in results:
        ref = base.get(r["batch"])
        r["decode_speedup_vs_bf16"] = r["decode_tok_s"] / ref["decode_tok_s"] if ref else None
        r["prefill_speedup_vs_bf16"] = r["prefill_tok_s"] / ref["prefill_tok_s"] if ref else None
        ref_graph = ref.get("graph_decode_tok_s") if ref else None
        graph = r.get("graph_decode_tok_s")
        r["graph_decode_speedup_vs_bf16"] = graph / ref_graph if graph and ref_graph else None
        ref_loop = ref.get("loop_decode_tok_s") if ref else None
        loop = r.get("loop_decode_tok_s")
        r["loop_decode_speedup_vs_bf16"] = loop / ref_loop if loop and ref_loop else None
        host, ref_host = r.get("host_ms_per_token"), ref.get("host_ms_per_token") if ref else None
        r["host_time_vs_bf16"] = host / ref_host if host is not None and ref_host else None


def acceptance(payload: dict[str, Any]) -> dict[str, Any]:
    """The bars of the issues, on CUDA (empty elsewhere), for kbit4 at batch 1.

    Llama-3-8B-shaped (issue 6): kbit4 >= 2.5x bf16 tokens/s; ``passed`` judges the generate() number,
    ``graph_passed`` the graph-step one and ``loop_passed`` the decode loop's (None when not measured).
    ``issue36``: generate() >= 1.8x bf16 (Llama-3-8B) or >= 2.0x (Qwen3-30B-A3B), kbit's host time per token
    within 10% of bf16's, and (Llama-3-8B, LM head in bf16) the graph step >= 2.6x.
    """
    if payload["preset"] not in ("llama3-8b", "qwen3-30b-a3b") or not payload["device"].startswith("cuda"):
        return {}
    k4 = next((r for r in payload["results"] if r["bits"] == 4 and r["batch"] == 1), None)
    if k4 is None or k4["decode_speedup_vs_bf16"] is None:
        return {}
    graph, loop = k4.get("graph_decode_speedup_vs_bf16"), k4.get("loop_decode_speedup_vs_bf16")
    host = k4.get("host_time_vs_bf16")
    llama = payload["preset"] == "llama3-8b"
    issue36 = {"generate_target": 1.8 if llama else 2.0, "host_time_vs_bf16": host}
    issue36["generate_passed"] = k4["decode_speedup_vs_bf16"] >= issue36["generate_target"]
    issue36["host_passed"] = host <= ISSUE36_HOST_TIME_MAX if host is not None else None
    if llama and not payload["lm_head_quantized"]:
        issue36["graph_passed"] = graph >= ISSUE36_GRAPH_STEP_MIN if graph is not None else None
    out = {"issue36": issue36}
    if llama:
        target = 2.5
        out.update({"llama3-8b_kbit4_batch1_decode_speedup": k4["decode_speedup_vs_bf16"], "target": target,
                    "passed": k4["decode_speedup_vs_bf16"] >= target,
                    "llama3-8b_kbit4_batch1_graph_decode_speedup": graph,
                    "graph_passed": graph >= target if graph is not None else None,
                    "llama3-8b_kbit4_batch1_loop_decode_speedup": loop,
                    "loop_passed": loop >= target if loop is not None else None})
    return out


def render_table(payload: dict[str, Any]) -> str:
    rows = [
        [r["variant"], r["bits_per_weight"], r["batch"], r["decode_tok_s"], r["ms_per_decode_step"],
         r["decode_speedup_vs_bf16"], r.get("graph_decode_tok_s"), r.get("graph_step_ms"),
         r.get("graph_decode_speedup_vs_bf16"), r.get("loop_decode_tok_s"), r.get("loop_step_ms"),
         r.get("loop_decode_speedup_vs_bf16"), r.get("device_ms_per_token"), r.get("host_ms_per_token"),
         r.get("loop_host_ms_per_token"), r["prefill_tok_s"]]
        for r in payload["results"]
    ]
    headers = ["variant", "bits/weight", "batch", "decode tok/s", "ms/step", "decode x bf16",
               "graph tok/s", "graph ms/step", "graph x bf16", "loop tok/s", "loop ms/step", "loop x bf16",
               "device ms/token", "host ms/token", "loop host ms/token", "prefill tok/s"]
    return format_table(headers, rows)
