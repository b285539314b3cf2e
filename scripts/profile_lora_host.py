"""Host time of a LoRA training step, measured on the CPU: what Python and torch spend issuing the step that
``scripts/bench_finetune.py`` times on the GPU, where a batch-1 step is launch-bound.

    python scripts/profile_lora_host.py                                     # bf16 vs kbit4
    python scripts/profile_lora_host.py --variants bf16,kbit2,kbit4 --profile kbit4

The model is Llama-3-8B's decoder (32 layers, 4 query heads per key/value head, MLP 3.5x) at hidden size
``--hidden`` and ``--seq-len`` tokens, so that compute is negligible and what is left is the host's work per
step: module calls, dispatch, autograd, gradient checkpointing's hooks and recompute, peft's layers, the
optimizer; LoRA, checkpointing and AdamW as in bench_finetune (hf_kbit.eval.finetune). For kbit variants that
is the CUDA path's own Python: hf_kbit.backends.cuda, registered for CPU tensors, over a stub of the kbit
library whose every call returns at once (built from ``STUB_SOURCE`` with the system's C compiler, ``$CC`` or
``cc``), planning dequantize + matmul as at training shapes; the matmuls run on the CPU at these tiny shapes.
The time is this process's CPU time (``time.process_time``), so other load on the machine does not count;
variants are interleaved over ``--rounds``, each reporting its best round's median step (and the median of its
round medians).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The kbit C ABI (csrc/kbit_api.h) with no work behind it. ABI is the version hf_kbit._lib expects.
STUB_SOURCE = r"""
#include <stdint.h>
int kbit_abi_version(void) { return ABI; }
const char* kbit_last_error(void) { return ""; }
int kbit_gemv_max_m(void) { return 0; }  /* no GEMV: training shapes are past it */
int kbit_kernel_table_size(void) { return 0; }
int kbit_kernel_table_entry(int i, const char** kernel, int* bits, int* dtype) { return 1; }
int kbit_mm_plan(int device, int64_t m, int64_t n, int64_t k, int bits, int dtype, int rotated, int* path,
                 int* gemm, int64_t* workspace) {
  *path = 2; *gemm = 0; *workspace = 0;  /* dequantize + matmul */
  return 0;
}
int64_t kbit_gemv_workspace_size(void) { return 0; }
int64_t kbit_gemm_workspace_size(void) { return 0; }
int64_t kbit_gemv_call_size(void) { return 64; }
int kbit_quantize(void) { return 0; }
int kbit_dequantize(void) { return 0; }
int kbit_gemv(void) { return 0; }
int kbit_gemm(void) { return 0; }
int kbit_gemm_plan(void) { return 0; }
int kbit_gemv_plan(void) { return 0; }
int kbit_set_gemm_kernel(int gemm) { return 0; }
int kbit_gemm_kernel(int device) { return 0; }
int kbit_set_wgmma_ws_plan(int nb, int splits) { return 0; }
int kbit_set_gemv_plan(int mode, int splits) { return 0; }
int kbit_set_mm_crossovers(void) { return 0; }
int kbit_gemv_prologue(void) { return 0; }
int kbit_gemv_prepare(void) { return 0; }
int kbit_gemv_run(void) { return 0; }
int kbit_grouped_gemv(void) { return 0; }
int64_t kbit_grouped_gemm_workspace_size(void) { return 0; }
int kbit_grouped_gemm(void) { return 0; }
int kbit_rotate(void) { return 0; }
int kbit_set_gemv_rotate_crossover(int bits, int in_staging_max_m) { return 0; }
int kbit_gemv_rotate_plan(int bits, int dtype, int64_t m, int prologue, int* mode) { *mode = 0; return 0; }
void kbit_trace_set(void* buffer) {}
"""


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="bf16,kbit4", help="comma-separated: bf16, kbit<k> (default bf16,kbit4)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 32; default 64)")
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--profile", default=None, metavar="VARIANT",
                        help="also print cProfile's top functions over 3 steps of VARIANT")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if "nf4" in args.variants:
        raise ValueError("--variants: nf4 needs bitsandbytes' GPU kernels; use bf16 and kbit<k>")
    for name in ("layers", "seq_len", "rank", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden < 32 or args.hidden % 32:
        raise ValueError(f"--hidden must be a positive multiple of 32 (8 heads of an even size), got {args.hidden}")
    if args.profile is not None and args.profile not in args.variants:
        raise ValueError(f"--profile {args.profile!r} is not one of --variants {args.variants}")
    return args


def abi_version() -> int:
    """hf_kbit._lib.ABI_VERSION, read without importing hf_kbit (whose import loads the library)."""
    package = importlib.util.find_spec("hf_kbit")  # an editable install lists the source folder among others
    path = next(p for p in (Path(d) / "_lib.py" for d in package.submodule_search_locations) if p.is_file())
    spec = importlib.util.spec_from_file_location("_kbit_lib_for_stub", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ABI_VERSION


def build_stub(folder: Path) -> Path:
    source, library = folder / "kbit_stub.c", folder / "libkbit_stub.so"
    source.write_text(STUB_SOURCE)
    compiler = os.environ.get("CC", "cc")
    command = [compiler, "-O2", "-shared", "-fPIC", f"-DABI={abi_version()}", "-o", str(library), str(source)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        raise RuntimeError(f"building the kbit library stub needs a C compiler ($CC or cc): {detail}") from e
    return library


def install_stub_backend(library: Path) -> None:
    """Load hf_kbit with ``library`` as its kbit library and hf_kbit.backends.cuda's ops serving CPU tensors.
    Must run before anything imports hf_kbit."""
    import torch

    if "hf_kbit" in sys.modules:
        raise RuntimeError("hf_kbit was imported before the stub backend was installed")
    os.environ["HF_KBIT_LIBRARY"] = str(library)
    torch._C._cuda_getCurrentRawStream = lambda index: 0  # the backend asks for torch's stream: none on CPU
    register = torch.library.impl

    def register_cuda_as_cpu(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == "hf_kbit.backends.cuda":
            args = tuple("CPU" if a == "CUDA" else a for a in args)
        return register(*args, **kwargs)

    torch.library.impl = register_cuda_as_cpu
    try:
        from hf_kbit.backends import cuda  # importing hf_kbit runs backends.load(): cuda over the stub
    finally:
        torch.library.impl = register
    from hf_kbit import _ops

    for registry in vars(_ops).values():  # what the backend registered per device type (policies, shortcuts)
        if isinstance(registry, dict) and "cuda" in registry:
            registry.setdefault("cpu", registry["cuda"])
    if not torch._C._dispatch_has_kernel_for_dispatch_key("kbit::mm", "CPU"):
        raise RuntimeError("hf_kbit.backends.cuda did not register over the stub: the CPU would time the reference")
    for name in dir(cuda._LIB):
        fn = getattr(cuda._LIB, name)
        if name.startswith("kbit_") and getattr(fn, "argtypes", None):
            fn.argtypes = None  # a CPU tensor's device index is None, which a c_int argument refuses


def tiny_config(layers: int, hidden: int):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "llama", vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 7 // 2, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
    )


def measure(setups: dict, args) -> dict[str, list[float]]:
    """Each variant's median CPU milliseconds per step, one per round, the variants interleaved."""
    from hf_kbit.eval.finetune import train_step

    medians: dict[str, list[float]] = {v: [] for v in setups}
    for _ in range(args.rounds):
        for variant, setup in setups.items():
            train_step(*setup)
            times = []
            for _ in range(args.steps):
                start = time.process_time()
                train_step(*setup)
                times.append(time.process_time() - start)
            medians[variant].append(statistics.median(times) * 1000)
    return medians


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        install_stub_backend(build_stub(Path(tmp)))
        import torch

        from hf_kbit.eval import finetune, report

        torch.set_num_threads(1)  # one thread: the host's work, not intra-op parallelism
        torch.set_flush_denormal(True)  # the stub dequantizes nothing: uninitialized weights must not be slow
        config = tiny_config(args.layers, args.hidden)
        setups = {}
        for variant in args.variants:
            finetune.check_variant(variant)
            setups[variant] = finetune.training_setup(config, variant, "cpu", args.rank,
                                                      not args.no_gradient_checkpointing, 1, args.seq_len)
            for _ in range(2):
                finetune.train_step(*setups[variant])
        medians = measure(setups, args)
    base = min(medians["bf16"]) if "bf16" in medians else None
    rows = [[v, min(m), statistics.median(m), min(m) / base if base else None] for v, m in medians.items()]
    print(f"host (CPU) ms per LoRA training step: {args.layers} layers, hidden {args.hidden}, {args.seq_len} tokens, "
          f"rank {args.rank}, gradient checkpointing {'off' if args.no_gradient_checkpointing else 'on'}; "
          f"kbit through hf_kbit.backends.cuda over a library stub")
    print(report.format_table(["variant", "best round ms", "median of rounds ms", "best x bf16"], rows))
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            finetune.train_step(*setups[args.profile])
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
