"""Device time of one greedy decode step captured in a CUDA graph (what a serving engine that captures its decode
step sees), without ``generate()``'s host work, and where that time goes (hf_kbit.eval.breakdown)."""

from __future__ import annotations

from typing import Any

from .breakdown import kbit_call_order, kernel_breakdown
from .timing import GreedyDecodeStep, prefilled_step, wall_clock_step_seconds

_GRAPH_SUBMIT_SPIN_CYCLES = 50_000_000  # about 25 ms at 2 GHz, longer than submitting a replay of 16 steps


def _spin_while_submitting() -> None:
    """Keep the GPU busy while the host submits a graph replay (hundreds of nodes per step take the host
    milliseconds), so that what follows times or profiles the replay's device work, not its submission."""
    import torch

    torch.cuda._sleep(_GRAPH_SUBMIT_SPIN_CYCLES)


def _cuda_graph_step_seconds(
    step: GreedyDecodeStep, steps: int, repeats: int, warmup: int, profile: bool = False, options: dict | None = None
) -> tuple[float, float, list[tuple[str, float, float]] | None]:
    """Compile the step's forward, capture ``steps`` chained steps in one CUDA graph, time replays with events.

    Returns (median seconds per step, the fraction of sequences whose last token after the first replay
    equals the one the compiled steps reached before capture, and with ``profile`` the kernels of one
    more replay: _profile_replay). A replay that does not advance the position by ``steps`` raises.
    Random-weight logits are nearly flat, so a sequence can diverge on a near-tie when a captured kernel
    rounds differently (cuBLAS may pick other kernels under capture): the fraction, not equality, is
    reported.
    """
    import statistics

    import torch

    # Default mode, not reduce-overhead: the graph is captured here, around whole steps (forward, argmax, updates).
    step.forward = torch.compile(step.forward, fullgraph=True, options=options)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the first call compiles; the rest leave nothing lazy for the capture
        for _ in range(max(warmup, 2)):
            step.rewind()
            try:
                for _ in range(steps):
                    step()
            except torch._dynamo.exc.TorchDynamoException as e:  # a graph break under fullgraph, or inductor failed
                raise RuntimeError(
                    f"graph step: torch.compile(fullgraph=True) failed on {step.model.config.model_type}'s decode step "
                    f"(run with --no-graph-step to skip it): {e}"
                ) from e
    torch.cuda.current_stream().wait_stream(side)
    expected = step.ids.clone()
    graph = torch.cuda.CUDAGraph()
    step.rewind()
    try:
        with torch.cuda.graph(graph):
            for _ in range(steps):
                step()
    except RuntimeError as e:
        raise RuntimeError(
            "graph step: capturing the compiled decode step in a CUDA graph failed (commonly an op that syncs with "
            f"the host or launches off the current stream; run with --no-graph-step to skip it): {e}"
        ) from e
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, matches = [], None
    for i in range(warmup + repeats):
        # Each replay advances the position and the cache's write position by ``steps`` in place: rewinding
        # first starts every replay at prompt_len, so positions stay inside the cache.
        step.rewind()
        _spin_while_submitting()
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        if matches is None:
            if step.position.item() != step.start + steps:
                raise RuntimeError(f"graph step: a replay moved the position to {step.position.item()}, "
                                   f"expected {step.start + steps}: the captured steps do not chain")
            matches = (step.ids == expected).float().mean().item()
        if i >= warmup:
            times.append(begin.elapsed_time(end) / 1000 / steps)
    kernels = _profile_replay(step, graph) if profile else None
    return statistics.median(times), matches, kernels



def _profile_replay(step: GreedyDecodeStep, graph) -> list[tuple[str, float, float]]:
    """(name, start, end) in microseconds of every CUDA kernel of one replay of ``graph`` (from the state right
    after prefill), in start order (CUPTI, through torch.profiler; the kernels of a graph replay are traced
    one by one). The spin kernel that covers the host's submission is left out."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step.rewind()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _spin_while_submitting()
        graph.replay()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = sorted((e for e in prof.events() if e.device_type == cuda), key=lambda e: e.time_range.start)
    kernels = [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events
               if not any(word in e.name.lower() for word in ("spin_kernel", "sleep"))]
    if not kernels:
        raise RuntimeError("kernel breakdown: torch.profiler recorded no CUDA kernel for the graph replay")
    return kernels


def measure_graph_step(model, batch: int, prompt_len: int, new_tokens: int, device: str, repeats: int = 3,
                       steps_per_graph: int = 16, warmup: int = 2, breakdown: bool = False,
                       fusion_pass: bool = False) -> dict[str, Any]:
    """Device time of one greedy decode step (``batch`` sequences, one token each), without ``generate``'s host work.

    A ``GreedyDecodeStep`` over a StaticCache of ``prompt_len + new_tokens`` positions, prefilled with a
    random prompt. On CUDA the step's forward is compiled (``torch.compile(fullgraph=True)``, default mode),
    ``min(steps_per_graph, new_tokens)`` chained steps are captured in one CUDA graph and each replay is
    timed with CUDA events: what a serving engine that captures its decode step sees. On CPU the same steps
    run eagerly, timed by wall clock (a smoke test of the pipeline). Medians over ``repeats`` after ``warmup``.
    ``graph_replay_tokens_match`` (CUDA only, else None): the fraction of sequences whose replay ends on
    the token that the same steps, compiled but not captured, reached (see _cuda_graph_step_seconds).
    ``breakdown`` (CUDA only): also ``graph_kernel_breakdown``, where the step's device time goes
    (kernel_breakdown of one more replay of the graph, with the exposed time of each kbit module that
    launches: kbit_call_order), else None.
    """
    if breakdown and not device.startswith("cuda"):
        raise ValueError(f"the kernel breakdown profiles CUDA kernels; device is {device!r}")
    if steps_per_graph < 1:
        raise ValueError(f"steps_per_graph must be >= 1, got {steps_per_graph}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1 to time a decode step, got {new_tokens}")
    steps = min(steps_per_graph, new_tokens)  # positions prompt_len..prompt_len+steps-1 stay inside the cache
    step = prefilled_step(model, batch, prompt_len, new_tokens, device, repeats)
    matches = None
    calls = kbit_call_order(step) if breakdown else None  # eager, before the forward is compiled
    kernels = None
    if device.startswith("cuda"):
        options = None
        if fusion_pass:
            from hf_kbit import fusion

            options = fusion.compile_options()
        step_s, matches, kernels = _cuda_graph_step_seconds(step, steps, repeats, warmup, profile=breakdown,
                                                            options=options)
    else:
        step_s = wall_clock_step_seconds(step, steps, repeats, warmup, device)
    split = kernel_breakdown(kernels, steps, kbit_calls=calls) if breakdown else None
    return {"graph_step_ms": 1000 * step_s, "graph_decode_tok_s": batch / step_s, "graph_steps": steps,
            "graph_replay_tokens_match": matches, "graph_kernel_breakdown": split}
