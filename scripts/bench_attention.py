"""Single-token attention on this GPU: hf_kbit's ``kbit_decode`` against transformers' ``sdpa``.

Each variant is the transformers attention function itself, compiled with torch.compile as a decode
step compiles it: ``sdpa`` copies the key/value heads once per query head (``repeat_kv``) and calls
scaled_dot_product_attention; ``kbit_decode`` runs hf_kbit.attention's Triton kernels on the
unrepeated cache. Llama-3-8B's heads (32 query, 8 key/value, head_dim 128), bf16, a boolean mask
with the first half of the cache live (a static cache half filled). DESIGN.md section 6: cold L2
(every timed call reads another copy of q, the cache and the mask; the copies together are several
times the L2), CUDA-graph replays timed with events. Writes JSON and a markdown table.

    python scripts/bench_attention.py --out benchmarks/results/h100_attention
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys

import torch
from bench_kernels import copies_for, settle, time_calls, write_results

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CASES = [(1, 256), (1, 1024), (1, 4096), (1, 16384), (8, 256), (8, 2048), (8, 8192)]  # (batch, cached tokens)


class _Layer(torch.nn.Module):
    num_key_value_groups = Q_HEADS // KV_HEADS
    is_causal = True


def inputs(batch: int, cached: int, copies: int):
    out = []
    for _ in range(copies):
        q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, KV_HEADS, cached, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        mask = (torch.arange(cached, device="cuda") < cached // 2 + 1).expand(batch, 1, 1, cached).contiguous()
        out.append((q, k, torch.randn_like(k), mask))
    return out


def bench_case(batch: int, cached: int) -> dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_kbit import attention
    from hf_kbit.backends import decode_attention

    layer, scale = _Layer(), HEAD_DIM**-0.5
    cache_bytes = 2 * batch * KV_HEADS * cached * HEAD_DIM * 2
    copies = inputs(batch, cached, copies_for(cache_bytes))
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    row = {"batch": batch, "cached_tokens": cached, "copies": len(copies), "cache_MB": cache_bytes / 2**20,
           "slices": decode_attention.plan_splits(batch, KV_HEADS, cached, sm_count)}
    for name, forward in (("sdpa", sdpa_attention_forward), ("kbit_decode", attention.decode_attention_forward)):
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v, m, forward=forward: forward(layer, q, k, v, m, scaling=scale)[0],
                           fullgraph=True)
        for args in copies[:2]:
            fn(*args)  # compile
        settle()
        row[f"{name}_us"] = time_calls([lambda args=args, fn=fn: fn(*args) for args in copies])
    row["speedup"] = row["sdpa_us"] / row["kbit_decode_us"]
    return row


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"Single-token attention, {meta['device']}, torch {meta['torch']}: Llama-3-8B heads ({Q_HEADS} query, "
        f"{KV_HEADS} key/value, head_dim {HEAD_DIM}), bf16, half the cache live; compiled transformers attention "
        "functions, cold L2, CUDA-graph replays, microseconds per call.",
        "",
        "| batch | cached tokens | KV cache MB | sdpa us | kbit_decode us | x sdpa | key slices |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['batch']} | {r['cached_tokens']} | {r['cache_MB']:.1f} | {r['sdpa_us']:.2f} | "
                     f"{r['kbit_decode_us']:.2f} | {r['speedup']:.2f}x | {r['slices']} |")
    lines += ["", f"`{meta['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="path prefix for .json and .md (default: print only)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    import hf_kbit

    results = []
    for batch, cached in CASES:
        results.append(bench_case(batch, cached))
        print(results[-1], flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hf_kbit": hf_kbit.__version__,
            "python": platform.python_version(),
            "command": shlex.join(["python", "scripts/bench_attention.py", *sys.argv[1:]])}
    md = markdown(results, meta)
    print(md)
    write_results(args.out, meta, results, md)


if __name__ == "__main__":
    main()
