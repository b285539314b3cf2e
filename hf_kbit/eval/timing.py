"""Decode speed of a model: ``generate()``'s prefill and decode tokens/s, and a greedy decode loop that the host
drives one token at a time (``GreedyDecodeStep``, the step that hf_kbit.eval.graph_step also captures in a CUDA
graph). On CPU everything runs eagerly, as a smoke test of the pipeline."""

from __future__ import annotations

import inspect
from typing import Any


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def capture_cuda_graph(fn):
    """``(graph, output)``: ``fn()`` captured in a CUDA graph after one warm-up call on a side stream (which
    leaves nothing lazy, such as cuBLAS workspaces or autotuning, for the capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def cache_argument(model) -> str:
    """The name ``model.forward`` takes its cache under: ``cache`` from transformers 5.24 (where
    ``past_key_values`` warns, until its removal in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def random_prompt(vocab_size: int, batch: int, prompt_len: int, device: str, seed: int = 0):
    """Random token ids ``[batch, prompt_len]`` (speed does not depend on which tokens)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, prompt_len), generator=gen).to(device)


def _median_seconds(fn, device: str, repeats: int) -> float:
    import statistics
    import time

    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_speed(
    model,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    device: str,
    static_compile: bool,
    repeats: int = 3,
    warmup: int = 1,
    fusion_pass: bool = False,
) -> dict[str, Any]:
    """Prefill and decode tokens/s of ``model.generate`` on random prompts.

    prefill: one forward over ``batch x prompt_len`` tokens (what generate's first step does).
    decode: ``batch * (new_tokens - 1)`` tokens over (generate time - prefill time), greedy,
    exactly ``new_tokens`` per sequence. ``static_compile``: a static KV cache, which lets
    transformers compile the decode step (torch.compile, CUDA graphs); otherwise eager with
    the dynamic cache. Medians over ``repeats`` after ``warmup`` runs (which compile). ``fusion_pass``:
    that compile runs hf_kbit.fusion's pass (``compile_config``).

    token_ms_median / token_ms_max: the decode steps one by one, host clock at each token's logits
    processing (a logits processor that only reads the clock), over the timed runs. generate() syncs
    the host with the GPU once per token (its check for finished sequences), so an interval is the
    step's device time plus the host work the GPU waits on; the median leaves out the rare slow
    tokens that the mean (``ms_per_decode_step``) includes.
    """
    import statistics
    import time

    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class TokenClock(LogitsProcessor):
        """Reads the host clock once per generated token; leaves the scores as they are."""

        def __init__(self):
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time decoding, got {new_tokens}")
    vocab = model.config.get_text_config().vocab_size
    ids = random_prompt(vocab, batch, prompt_len, device)
    mask = torch.ones_like(ids)
    gen_kwargs: dict[str, Any] = {
        "attention_mask": mask,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "pad_token_id": 0,
    }
    if static_compile:
        gen_kwargs["cache_implementation"] = "static"
        if fusion_pass:
            from hf_kbit import fusion

            gen_kwargs["compile_config"] = fusion.compile_config()
    else:
        gen_kwargs["disable_compile"] = True

    def prefill():
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)

    clock = TokenClock()

    def generate():
        with torch.inference_mode():
            out = model.generate(ids, logits_processor=LogitsProcessorList([clock]), **gen_kwargs)
        if out.shape[1] != prompt_len + new_tokens:
            raise RuntimeError(f"generate returned {out.shape[1] - prompt_len} new tokens, expected {new_tokens}")

    for _ in range(warmup):
        generate()
        prefill()
    t_prefill = _median_seconds(prefill, device, repeats)
    step_s = []  # the timed runs' decode steps: differences of a run's consecutive stamps (the first follows prefill)

    def timed_generate():
        clock.stamps.clear()
        generate()
        step_s.extend(b - a for a, b in zip(clock.stamps, clock.stamps[1:]))

    t_generate = _median_seconds(timed_generate, device, repeats)
    decode_s = max(t_generate - t_prefill, 1e-9)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "static_cache": static_compile,
        "compiled": getattr(model, "_compiled_call", None) is not None,
        "prefill_s": t_prefill,
        "generate_s": t_generate,
        "prefill_tok_s": batch * prompt_len / t_prefill,
        "decode_tok_s": batch * (new_tokens - 1) / decode_s,
        "ms_per_decode_step": 1000 * decode_s / (new_tokens - 1),
        "token_ms_median": 1000 * statistics.median(step_s),
        "token_ms_max": 1000 * max(step_s),
    }


class GreedyDecodeStep:
    """One greedy decode step on static tensors: replaying it (eager, compiled or in a CUDA graph) chains tokens.

    Building it prefills ``prompt`` ([batch, prompt_len] int64) into a fresh ``transformers.StaticCache`` of
    ``max_cache_len`` positions. Then each call feeds one token per sequence and updates, in place:

    - ``ids``: [batch, 1] int64, the token fed; overwritten by the argmax of the step's logits.
    - ``position``: [1, 1] int64, that token's position (the forward's ``position_ids``, which the rotary
      embedding reads); advanced by one.
    - the cache's write position: each StaticLayer's ``cumulative_length``, a 0-dim device tensor that the
      cache update advances. transformers 5.x forwards take no ``cache_position``; the causal mask and the KV
      write position come from this counter, so it must move in step with ``position``.

    ``rewind()`` puts all three back to the state right after prefill, so a captured graph can be replayed
    from the same start; KV entries past the start are stale but masked until overwritten.
    """

    def __init__(self, model, prompt, max_cache_len: int):
        import torch
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        if prompt.dim() != 2 or prompt.dtype != torch.long:
            raise ValueError(
                f"prompt must be int64 token ids [batch, prompt_len], got {prompt.dtype} {tuple(prompt.shape)}"
            )
        prompt_len = prompt.shape[1]
        if max_cache_len <= prompt_len:
            raise ValueError(
                f"max_cache_len must exceed prompt_len ({prompt_len}) to leave room to decode, got {max_cache_len}"
            )
        self.model, self.prompt, self.max_cache_len, self.start = model, prompt, max_cache_len, prompt_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.cache_arg = cache_argument(model)
        kinds = {type(layer).__name__ for layer in self.cache.layers if type(layer) is not StaticLayer}
        if kinds:  # sliding-window layers keep a host-side counter a replayed graph would not advance
            raise ValueError(
                f"the decode step supports full-attention static caches only; {model.config.model_type} "
                f"has {sorted(kinds)} layers (run with --no-graph-step)"
            )
        with torch.inference_mode():
            positions = torch.arange(prompt_len, device=prompt.device)[None]
            out = model(
                input_ids=prompt, position_ids=positions, use_cache=True, logits_to_keep=1, **{self.cache_arg: self.cache}
            )
            self.first_token = out.logits[:, -1].argmax(-1, keepdim=True)
            self.ids = self.first_token.clone()
            self.position = torch.full((1, 1), prompt_len, dtype=torch.long, device=prompt.device)

    def forward(self, ids, position):
        """Logits [batch, vocab] of the token ``ids`` at ``position``; writes its keys and values into the cache."""
        out = self.model(
            input_ids=ids, position_ids=position, use_cache=True, logits_to_keep=1, **{self.cache_arg: self.cache}
        )
        return out.logits[:, -1]

    def __call__(self) -> None:
        import torch

        with torch.inference_mode():  # the cache holds inference tensors: updating them needs the mode
            logits = self.forward(self.ids, self.position)
            self.ids.copy_(logits.argmax(-1, keepdim=True))
            self.position.add_(1)

    def rewind(self) -> None:
        """Back to the state right after prefill: first token, position and cache write position at prompt_len."""
        import torch

        with torch.inference_mode():
            self.ids.copy_(self.first_token)
            self.position.fill_(self.start)
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(self.start)

    def tokens(self, n: int):
        """The first ``n`` greedy tokens [batch, n]: the prefill's, then ``n - 1`` steps (rewinds first)."""
        import torch

        if not 1 <= n <= self.max_cache_len - self.start + 1:
            raise ValueError(f"n must be in [1, {self.max_cache_len - self.start + 1}] for this cache, got {n}")
        self.rewind()
        out = [self.ids.clone()]
        for _ in range(n - 1):
            self()
            out.append(self.ids.clone())
        return torch.cat(out, dim=1)


def prefilled_step(model, batch: int, prompt_len: int, new_tokens: int, device: str, repeats: int) -> GreedyDecodeStep:
    """A GreedyDecodeStep prefilled with a random prompt ``[batch, prompt_len]``, its cache long enough for
    ``new_tokens`` more; checks ``repeats`` (the timed runs that will use it) first."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    prompt = random_prompt(model.config.get_text_config().vocab_size, batch, prompt_len, device)
    return GreedyDecodeStep(model, prompt, prompt_len + new_tokens)


def wall_clock_step_seconds(step: GreedyDecodeStep, steps: int, repeats: int, warmup: int, device: str) -> float:
    """Median wall-clock seconds per step of ``steps`` chained calls from the rewound state, the host synced with
    ``device`` before the first call and after the last only."""
    import statistics
    import time

    times = []
    for i in range(warmup + repeats):
        step.rewind()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)



def measure_decode_loop(model, batch: int, prompt_len: int, new_tokens: int, device: str, repeats: int = 3,
                        warmup: int = 2, fusion_pass: bool = False) -> dict[str, Any]:
    """Wall-clock tokens/s of a greedy decode loop that the host drives one token at a time, with no sync per token.

    A ``GreedyDecodeStep`` over a StaticCache of ``prompt_len + new_tokens`` positions, prefilled with a random
    prompt, runs ``new_tokens - 1`` steps per timed run; the host waits for the GPU once, after the last step
    (generate() waits once per token, for its stopping check). On CUDA the step's forward is compiled as
    generate() compiles its decode step (``fullgraph=True``, inductor's CUDA graphs: ``mode="reduce-overhead"``,
    or hf_kbit.fusion's options with them under ``fusion_pass``), so every step is dynamo's guards, one graph
    replay and the argmax fed back; the host's work overlaps the GPU's as long as the host keeps ahead. On
    CPU the steps run eagerly. Medians over ``repeats`` after ``warmup`` runs (the first compiles).

    ``loop_tokens_argmax_match``: the fraction of one more run's tokens that equal the argmax of an eager
    forward over the prompt and the tokens before each (teacher forcing). 1 where the loop decodes what the
    model computes; a flipped near-tie (random-weight logits are nearly flat) costs one token, not the rest.
    """
    import torch

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time a decode loop, got {new_tokens}")
    steps = new_tokens - 1
    step = prefilled_step(model, batch, prompt_len, new_tokens, device, repeats)
    prompt = step.prompt
    if device.startswith("cuda"):
        if fusion_pass:
            from hf_kbit import fusion

            step.forward = torch.compile(step.forward, fullgraph=True, options=fusion.compile_options(cudagraphs=True))
        else:
            step.forward = torch.compile(step.forward, fullgraph=True, mode="reduce-overhead")
    step_s = wall_clock_step_seconds(step, steps, repeats, warmup, device)
    if step.position.item() != prompt_len + steps:
        raise RuntimeError(f"decode loop: {steps} steps moved the position to {step.position.item()}, "
                           f"expected {prompt_len + steps}")
    tokens = step.tokens(new_tokens)  # [batch, new_tokens]: the prefill's token, then the loop's
    with torch.inference_mode():
        logits = model(input_ids=torch.cat([prompt, tokens[:, :-1]], dim=1), use_cache=False,
                       logits_to_keep=new_tokens).logits
    match = (logits.argmax(-1) == tokens).float().mean().item()
    return {"loop_step_ms": 1000 * step_s, "loop_decode_tok_s": batch / step_s, "loop_steps": steps,
            "loop_tokens_argmax_match": match}


# Kernel groups of the decode-step breakdown, by where a kernel comes from (its demangled name). First match
