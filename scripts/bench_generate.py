"""Decode speed of real-size models with random weights: bf16 vs kbit, batch 1 and 8.

Issue 36's benchmark of the user's path (H100; the JSON names the GPU; bf16 in the same run):

    python scripts/bench_generate.py --preset llama3-8b --bits 4 --kernel-breakdown
    python scripts/bench_generate.py --preset llama3-8b --bits 4 --recommended --kernel-breakdown
    python scripts/bench_generate.py --preset qwen3-30b-a3b --layers 48 --bits 4
    python scripts/bench_generate.py --preset qwen3-30b-a3b --layers 48 --bits 4 --recommended

The first of each pair measures the defaults, what a user gets with nothing opted in: kbit models as
``KbitConfig()`` leaves them (fused projections; ``generate()``'s compile with hf_kbit.fusion's pass,
combo kernels and PDL on sm_90+, ``KbitConfig.fusion_pass``; hf_kbit's ``kbit_decode`` attention,
``KbitConfig.decode_attention``), bf16 as transformers builds and compiles it (sdpa attention); LM head in
bf16. ``--recommended`` adds the one-line choice that the README, the model card and kbit-convert name, the LM
head quantized, and gives bf16 the same attention (``attn_implementation="kbit_decode"`` on every variant).
No ``TORCHINDUCTOR_ENABLE_PDL`` in the environment: bf16 then runs without PDL, as its users do.

What rotation costs a decoding model, where each rotated GEMV follows another kernel (its sign words are
prefetched before the programmatic-dependent wait), against the same run without it (issue 34):

    python scripts/bench_generate.py --preset llama3-8b --bits 3 --batch-sizes 1,8 --rotation on

and what block offsets (format v4's int16 block records, on by default) cost it, against a run without them:

    python scripts/bench_generate.py --preset llama3-8b --bits 4 --block-offsets off

Host and device time per token are reported apart (``device_ms_per_token``, ``host_ms_per_token``):
the device time of a decode step is the graph step's (below: the compiled step captured in a CUDA graph,
timed with CUDA events while the host is out of the way), compiled with the same options as the
variant's ``generate()``; the host time per token is the median wall-clock interval between two
tokens of ``generate()`` (``token_ms_median``) minus that device time: what the GPU spends waiting for
the host each token (dynamo's guards, the graph launch, generate()'s logits processing and its host
sync). ``loop_host_ms_per_token`` does the same for the decode loop (no per-token sync, no logits
processing): the compiled call's own host cost that the GPU could not hide.

The models are built from their published configs (values written below, nothing is
downloaded) with random weights, so any architecture size can be timed without a checkpoint.
``--layers N`` keeps only the first N decoder layers (stated in the output) to fit memory or
time. Every variant is built from the same seed; kbit variants are quantized in memory with
``hf_kbit.quantize_model``. The LM head stays bf16, as in quantize-on-load, unless
``--quantize-lm-head`` (then it takes the same k; the JSON records ``lm_head_quantized``).
Sibling projections that read the same input (q/k/v, gate/up) run as one kbit launch each, as
``KbitConfig(fuse_projections=True)`` (the default) does; ``--no-fuse-projections`` launches
every projection on its own (the JSON records ``fused_projections``).

Three decode numbers, reported side by side:

- generate(): tokens/s of ``model.generate`` (greedy), prefill time subtracted. On CUDA: static
  KV cache + torch.compile, what ``generate`` does for a compileable quantizer. It includes
  generate's host work per token (logits processing, a host sync to check stopping), which the
  GPU waits on; the faster the layers, the larger the share of that fixed cost, so on an H100 it
  hides much of what quantized layers gain. The JSON adds the decode steps' median and maximum
  (``token_ms_median`` / ``token_ms_max``, a host clock at each token); the median, unlike the
  mean, is not moved by the rare slow tokens.
- graph step: device time of one greedy decode step (forward over a StaticCache, argmax fed
  back as the next token), compiled with ``torch.compile(fullgraph=True)``, 16 chained steps
  (``--steps-per-graph``) captured in one CUDA graph, replays timed with CUDA events (the GPU
  spins while the host submits each replay, so the submission is not timed). It is
  what a serving engine that captures its decode step in a CUDA graph sees; tokens/s = batch /
  step time. ``--no-graph-step`` skips it.
- decode loop: wall-clock tokens/s of a greedy loop that the host drives token by token, the
  step's forward compiled as generate() compiles it (static cache, fullgraph, inductor's CUDA
  graphs), the argmax fed back on the GPU, and one host sync after the last token instead of
  generate()'s one per token. It is the graph step plus whatever host work per step (dynamo's
  guards, the replay's submission) the GPU cannot hide; ``loop_tokens_argmax_match`` checks the
  tokens against an eager forward (teacher forcing). ``--no-decode-loop`` skips it.

With ``TORCHINDUCTOR_ENABLE_PDL=1`` in the environment inductor's Triton kernels launch as programmatic
dependents (sm_90+), so the kernels around them overlap their launch and prologue; the JSON records it
(``inductor_pdl``).

hf_kbit.fusion's inductor pass moves the residual add + RMSNorm and the SiLU-mul in front of the kbit
projections into their GEMVs (single-token calls only, its default); its compile options also turn on
inductor's combo kernels, which launch each layer's small independent kernels (RoPE, cache writes, mask)
as one, and PDL on sm_90+. By default kbit variants compile their decode steps (generate()'s, the graph
step's, the loop's) with it, as a kbit model's ``generate()`` does, and bf16 variants as transformers
does. ``--fusion-pass`` (CUDA) compiles every variant with it, bf16 too (nothing to rewrite there, but
combo kernels and PDL); ``--no-fusion-pass`` none (kbit models built with ``KbitConfig(fusion_pass=False)``).
The JSON records ``fusion_pass`` (None: the default) and, per row, ``fusion_pass`` and ``combo_kernels``.

``--attention`` (default ``default``: each variant's own, bf16 transformers' ``sdpa`` and kbit hf_kbit's
``kbit_decode``) ``kbit_decode`` or ``sdpa`` builds every variant with that attention: hf_kbit.attention's
single-token grouped-query attention, or transformers' ``sdpa`` (which copies each key/value head once per
query head before attending; kbit variants then take ``KbitConfig(decode_attention=False)``). The ratio then
compares the same attention on both sides. The JSON records ``attention``, and each row the attention its
model ran.

``--kernel-breakdown`` (CUDA) adds where the graph step's device time goes: one more replay of the
graph under torch.profiler, each kernel charged its exposed time (from the end of the kernels before
it to its own end; the groups and the idle gaps add up to the step), summed per step by kernel origin
(hf_kbit's kernels, cuBLAS, attention, inductor's Triton kernels, other), the largest kernels by name
(JSON) and each kbit module's exposed time per call (a fused ``qkv_proj`` / ``gate_up_proj`` for its
members).

The JSON is written after every variant, marked ``"complete": false`` until the last one, so a run
that is stopped (a time limit, an out-of-memory error) keeps what it measured. ``--resume`` finishes
such a run: it keeps the variants the ``--out`` file holds, checks that they were measured with the
same settings (model, layers, device and GPU, dtype, batch sizes, lengths, repeats, LM head,
fusion, combo kernels, attention, inductor PDL, graph step, decode loop), measures the others and
records the kept ones in ``resumed_variants``: their numbers, bf16's among them, come from the earlier
process.

On CPU all three run eagerly, for a smoke test of the pipeline only (the kbit CPU forward is the reference).

    python scripts/bench_generate.py --preset llama3-8b                       # H100
    python scripts/bench_generate.py --preset qwen3-30b-a3b --layers 24       # H100
    python scripts/bench_generate.py --preset tiny-llama --device cpu        # smoke test
    python scripts/bench_generate.py --preset tiny-qwen3-moe --device cpu --recommended   # smoke test, MoE
    python scripts/bench_generate.py --preset qwen3-30b-a3b --layers 24 --resume   # finish a stopped run
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hf_kbit.eval.breakdown import kbit_module_summary, kernel_breakdown_table
from hf_kbit.eval.decode_bench import render_table, resumable_results, run, settings, variant_bits, variant_name
from hf_kbit.eval.models import ATTENTIONS, add_device_arguments, pick_device, pick_dtype
from hf_kbit.eval.presets import PRESETS, make_config
from hf_kbit.eval.report import command_line, environment, parse_bits, write_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b", help=f"one of {', '.join(PRESETS)} (default llama3-8b)")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (stated in output)")
    parser.add_argument("--bits", default="2,3,4,5", help="comma-separated kbit widths (default 2,3,4,5)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 baseline")
    parser.add_argument("--batch-sizes", default="1,8", help="default 1,8")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per run (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point, median reported")
    parser.add_argument("--no-compile", action="store_true",
                        help="on CUDA, time generate() eager with a dynamic cache (the graph step still compiles)")
    parser.add_argument("--no-graph-step", action="store_true",
                        help="skip the graph step (compiled decode step replayed in a CUDA graph)")
    parser.add_argument("--no-decode-loop", action="store_true",
                        help="skip the decode loop (wall clock, compiled like generate(), no host sync per token)")
    parser.add_argument("--steps-per-graph", type=int, default=16,
                        help="graph step: chained decode steps per CUDA graph (default 16, at most --new-tokens)")
    parser.add_argument("--kernel-breakdown", action="store_true",
                        help="CUDA: profile the graph step's kernels; device time per step by origin and "
                             "per kbit module")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="quantize the LM head too (default: it stays bf16, as in quantize-on-load)")
    parser.add_argument("--no-fuse-projections", action="store_true",
                        help="launch q/k/v and gate/up separately (default: one fused launch each, as KbitConfig's default)")
    fusion = parser.add_mutually_exclusive_group()
    fusion.add_argument("--fusion-pass", action="store_true", default=None,
                        help="CUDA: compile every variant's decode steps (generate()'s, the graph step's, the loop's) "
                             "with hf_kbit.fusion's options, bf16 too (default: kbit variants only, as their "
                             "generate() does)")
    fusion.add_argument("--no-fusion-pass", dest="fusion_pass", action="store_false", default=None,
                        help="compile no variant with hf_kbit.fusion's options (kbit: KbitConfig(fusion_pass=False))")
    parser.add_argument("--rotation", choices=("off", "on", "inputs", "auto"), default="off",
                        help="the kbit variants' KbitConfig.rotation (format v3, docs/format.md#rotation): 'on' "
                        "every weight whose in_features is a multiple of 64, 'inputs' those of the input projections "
                        "(not o/down), 'auto' where it lowers the weight error; "
                        "the random weights make 'auto' a test of the decision, not of a real model (default off)")
    parser.add_argument("--block-offsets", nargs="?", const="on", choices=("on", "off"), default=None,
                        help="the kbit variants' KbitConfig.block_offsets (format v4's block records, "
                             "docs/format.md#block-offsets; default: KbitConfig's, on unless rotated; the flag alone "
                             "is 'on')")
    parser.add_argument("--recommended", action="store_true",
                        help="the recommended settings: --attention kbit_decode and --quantize-lm-head")
    parser.add_argument("--attention", default="default", choices=ATTENTIONS,
                        help="'default': each variant's own (bf16: transformers' sdpa; kbit: hf_kbit's kbit_decode, "
                             "KbitConfig.decode_attention); 'sdpa' or 'kbit_decode': that attention in every variant")
    add_device_arguments(parser, dtype="bf16")
    parser.add_argument("--out", default=None, help="JSON path (default: results/bench_generate_<preset>_<device>"
                                                   "[_lmhead][_kbit_decode|_sdpa].json)")
    parser.add_argument("--resume", action="store_true",
                        help="finish the stopped run in --out: keep its variants (same arguments and GPU required), "
                             "measure the others")
    args = parser.parse_args(argv)
    if args.recommended:
        if args.attention not in ("default", "kbit_decode"):
            parser.error(f"--recommended sets --attention kbit_decode, got --attention {args.attention}")
        args.attention, args.quantize_lm_head = "kbit_decode", True

    bits_list = parse_bits(args.bits)
    batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    make_config(args.preset, args.layers)  # validate before touching the device
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    options = dict(
        layers=args.layers, batch_sizes=batch_sizes, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        repeats=args.repeats, static_compile=False if args.no_compile else None,
        graph_step=not args.no_graph_step, steps_per_graph=args.steps_per_graph,
        decode_loop=not args.no_decode_loop, quantize_lm_head=args.quantize_lm_head,
        kernel_breakdown=args.kernel_breakdown,
        fuse_projections=not args.no_fuse_projections, fusion_pass=args.fusion_pass, attention=args.attention,
        rotation={"off": False, "on": True, "inputs": "inputs", "auto": "auto"}[args.rotation],
        block_offsets=None if args.block_offsets is None else args.block_offsets == "on",
    )
    head = "_lmhead" if args.quantize_lm_head else ""
    attention = "" if args.attention == "default" else f"_{args.attention}"
    suffix = ("_recommended" if args.recommended else f"{head}{attention}") + (
        "" if args.rotation == "off" else f"_rotation_{args.rotation}") + (
        "" if args.block_offsets is None else f"_offsets_{args.block_offsets}")
    out = args.out or f"results/bench_generate_{args.preset}_{device.split(':')[0]}{suffix}.json"
    machine = environment()
    kept = None
    if args.resume:
        names = [variant_name(b) for b in variant_bits(bits_list, not args.no_bf16)]
        expected = settings(args.preset, names, device, dtype, **options)
        kept = resumable_results(out, expected, machine.get("gpu"))

    def write(payload: dict[str, Any]) -> None:
        env = "TORCHINDUCTOR_ENABLE_PDL=1 " if payload["inductor_pdl"] else ""  # it changes what is timed
        payload["command"] = env + command_line()
        payload["environment"] = machine
        write_json(out, payload)

    payload = run(args.preset, bits_list, device, dtype, include_bf16=not args.no_bf16, kept=kept,
                  on_variant=write, **options)
    write(payload)
    print()
    layers = f"{payload['layers']} of {payload['layers_full']} layers"
    print(f"{payload['model']} ({layers}, random weights) on {device}, {payload['compute_dtype']}, "
          f"{'static cache + torch.compile' if payload['static_cache_and_compile'] else 'eager'}")
    if payload["graph_step"]:
        g = payload["graph_step"]
        how = f"compiled, {g['steps_per_graph']} steps per CUDA graph" if g["compiled"] else "eager, wall clock"
        print(f"graph step: one greedy decode step without generate()'s host work ({how})")
    if payload["decode_loop"]:
        how = "compiled with CUDA graphs" if payload["decode_loop"]["compiled"] else "eager"
        print(f"decode loop: wall clock of {payload['decode_loop']['steps']} greedy steps, one host sync ({how})")
    print(render_table(payload))
    if breakdown := kernel_breakdown_table(payload["results"]):
        print("\ngraph step device time by kernel origin (one profiled replay, exposed microseconds per step)")
        print(breakdown)
        for r in payload["results"]:
            if r.get("graph_kernel_breakdown") and (modules := kbit_module_summary(r["graph_kernel_breakdown"])):
                print(f"{r['variant']} batch {r['batch']}, exposed us per call of each kbit module's kernel: {modules}")
    if payload["checks"]:
        print(f"\nacceptance (kbit4 batch 1; issue 6: >= 2.5x bf16, issue36): {payload['checks']}")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
