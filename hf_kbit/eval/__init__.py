"""Quality evaluation of quantized models: perplexity on fixed token windows, anchors, paired statistics.

Not imported by ``import hf_kbit``. Modules:

- ``perplexity``: windows over a token stream, per-window negative log-likelihoods, paired deltas.
- ``anchors``: other formats as fake-quantized Linears (HQQ, RTN int, NF4) with their storage cost.
- ``variants``: what one evaluated variant is (``kbit3:codebook=nf``, ``hqq4``, ...) and how it loads.
- ``harness``: every variant on the same windows, as a JSON-ready payload and a markdown table.
- ``corpus`` (with ``rdata``): the corpora.

Optional dependencies (``hqq``) are imported where they are used; ``pip install hf-kbit[eval]`` brings them.
"""
