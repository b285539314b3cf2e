"""The kernel table (hf_kbit/kernel_table.py) is the one list of what is supported: the generated
C++ files, the Python constants and the compiled library must all agree with it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from hf_kbit import _lib, cli, config, kernel_table
from hf_kbit import format as fmt

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("generate_kernels", ROOT / "csrc" / "generate_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_generated_files_are_up_to_date():
    gen = _generator()
    assert gen.stale(gen.render()) == [], "run `python csrc/generate_kernels.py` and commit the result"


def test_every_table_entry_is_instantiated_and_dispatched():
    gen = _generator()
    files = gen.render()
    header = files[gen.HEADER]
    units = "".join(text for path, text in files.items() if path != gen.HEADER)
    for kernel, bits, dtype in kernel_table.TABLE:
        launch = gen.LAUNCHES[kernel]
        for v in launch.variants or (0,):
            for rot in ("false", "true") if v in launch.rotated else ("false",):
                inst = launch.template.format(bits=bits, T=gen.CPP_TYPES[dtype], v=v, rot=rot)
                assert f"template cudaError_t {inst}(" in units, (kernel, bits, dtype, v, rot)
                assert f"return &{inst};" in header, (kernel, bits, dtype, v, rot)


def test_rotated_instantiations_only_where_listed():
    # The rotated code is built only for the tiles its launch lists (build time on 2-core CI): the
    # others rotate x with the standalone kernel first (kbit_api.cu).
    gen = _generator()
    units = "".join(text for path, text in gen.render().items() if path != gen.HEADER)
    for name, launch in gen.LAUNCHES.items():
        assert set(launch.rotated) <= set(launch.variants), name
        if not launch.rotated:
            assert "{rot}" not in launch.template, name
            continue
        assert "{rot}" in launch.template, name
        for v in set(launch.variants) - set(launch.rotated):
            inst = launch.template.format(bits=2, T="__half", v=v, rot="true")
            assert inst not in units, inst


def test_generator_check_mode_runs_without_torch():
    # The wheel build and contributors run it with any Python: it must not import the package.
    code = "import sys, runpy; sys.modules['torch'] = None; sys.argv = ['g', '--check']; " \
           f"runpy.run_path({str(ROOT / 'csrc' / 'generate_kernels.py')!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_python_supported_bits_read_the_table():
    assert kernel_table.SUPPORTED_BITS == kernel_table.BITS
    assert fmt.SUPPORTED_BITS == cli.SUPPORTED_BITS == kernel_table.SUPPORTED_BITS
    for bits in kernel_table.SUPPORTED_BITS:
        assert config.KbitConfig(bits=bits).bits == bits
    with pytest.raises(ValueError, match="bits"):
        config.KbitConfig(bits=max(kernel_table.BITS) + 1)
    for kernel in kernel_table.KERNELS:
        assert set(kernel_table.SUPPORTED_BITS) <= set(kernel_table.bits_of(kernel))


def test_table_has_no_duplicates_and_known_names():
    assert len(set(kernel_table.TABLE)) == len(kernel_table.TABLE)
    gen = _generator()
    assert set(kernel_table.KERNELS) == set(gen.LAUNCHES)
    assert {d for _, _, d in kernel_table.TABLE} <= set(kernel_table.DTYPES) == set(_lib.DTYPE_CODES)
    assert tuple(_lib.DTYPE_CODES) == kernel_table.DTYPES  # the C ABI codes are the indices


@pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)")
def test_compiled_library_holds_the_table():
    assert _lib.kernel_table() == kernel_table.TABLE


@pytest.mark.skipif(not _lib.available(), reason="needs the compiled kbit CUDA library (libhf_kbit_cuda.so)")
@pytest.mark.parametrize("call", ["dequantize_bits", "gemv_float32", "grouped_bits"])
def test_library_refuses_entries_outside_the_table(call):
    # Checked before any CUDA call: runs without a GPU.
    lib = _lib.load()
    bits = max(kernel_table.BITS) + 1
    if call == "dequantize_bits":
        rc = lib.kbit_dequantize(0, None, None, None, None, None, 0, bits, 1, 1, 1, None, 2, None)
        expected = f"kernel=dequantize, bits={bits}, dtype=bfloat16"
    elif call == "gemv_float32":
        rc = lib.kbit_gemv(0, None, None, 0, None, None, None, None, 4, 1, 1, 1, None, None, 0, None)
        expected = "kernel=gemv, bits=4, dtype=float32"
    else:
        rc = lib.kbit_grouped_gemv(0, None, None, 1, None, None, None, None, None, None, None, bits, 1, 1, 1, 1, None,
                                    None, 1)
        expected = f"kernel=grouped_gemv, bits={bits}, dtype=float16"
    with pytest.raises(ValueError, match=f"unsupported {expected}"):
        _lib.check(rc, call)
