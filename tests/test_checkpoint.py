"""hf_kbit.checkpoint: safetensors headers and kbit tensors checked before loading, errors naming file and key."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from hf_kbit import KbitLinear
from hf_kbit.checkpoint import KbitCheckpointError, read_safetensors_header, validate_files

KEY = "layer.planes"


def _write(path: Path, header, data: bytes = b"\0" * 64) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _entry(**fields) -> dict:
    return {"dtype": "I32", "shape": [4, 4], "data_offsets": [0, 64], **fields}


def test_reads_a_valid_header(tmp_path):
    path = tmp_path / "ok.safetensors"
    save_file({KEY: torch.zeros(4, 4, dtype=torch.int32)}, path, metadata={"format": "pt"})
    header = read_safetensors_header(path)
    assert header[KEY] == _entry() and header["__metadata__"] == {"format": "pt"}


MALFORMED = {
    "json-list": ([[KEY, _entry()]], r"header is a JSON array, expected an object"),
    "json-string": ("model", r"header is a JSON string"),
    "entry-list": ({KEY: [0, 64]}, rf"tensor '{KEY}' has a header entry that is a JSON array"),
    "entry-null": ({KEY: None}, rf"tensor '{KEY}' has a header entry that is a JSON null"),
    "corrupt-metadata-key": ({"__metadatx__": {"format": "pt"}, KEY: _entry()}, r"tensor '__metadatx__'"),
    "metadata-not-object": ({"__metadata__": [1], KEY: _entry()}, r"'__metadata__' is a JSON array"),
    "dtype-missing": ({KEY: {"shape": [4, 4], "data_offsets": [0, 64]}}, r"'dtype' must be a string, got None"),
    "shape-not-list": ({KEY: _entry(shape="4x4")}, r"'shape' must be a list of non-negative ints, got '4x4'"),
    "shape-negative": ({KEY: _entry(shape=[-4, 4])}, r"'shape' must be .*, got \[-4, 4\]"),
    "offsets-missing": ({KEY: {"dtype": "I32", "shape": [4, 4]}}, r"'data_offsets' must be \[start, end\].*got None"),
    "offsets-not-list": ({KEY: _entry(data_offsets=64)}, r"'data_offsets' must be .*, got 64"),
    "offsets-one": ({KEY: _entry(data_offsets=[64])}, r"'data_offsets' must be .*, got \[64\]"),
    "offsets-negative": ({KEY: _entry(data_offsets=[-4, 60])}, r"'data_offsets' must be .*, got \[-4, 60\]"),
    "offsets-float": ({KEY: _entry(data_offsets=[0.0, 64.0])}, r"'data_offsets' must be .*, got \[0\.0, 64\.0\]"),
    "offsets-bool": ({KEY: _entry(data_offsets=[False, True])}, r"'data_offsets' must be .*, got \[False, True\]"),
    "offsets-reversed": ({KEY: _entry(data_offsets=[64, 0])}, r"'data_offsets' \[64, 0\] start after they end"),
    "past-the-end": ({KEY: _entry(data_offsets=[0, 640])}, rf"tensor '{KEY}' ends at byte 640 .* truncated"),
}


@pytest.mark.parametrize("header, message", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_header_names_file_and_key(tmp_path, header, message):
    path = _write(tmp_path / "bad.safetensors", header)
    with pytest.raises(KbitCheckpointError, match=r"bad\.safetensors.*" + message):
        read_safetensors_header(path)


@pytest.mark.parametrize(
    "raw", [b"{not json", b"\xff\xfe{}", b"[" * 100_000], ids=["not-json", "not-utf8", "nested-too-deep"]
)
def test_unreadable_header(tmp_path, raw):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(KbitCheckpointError, match=r"bad\.safetensors: unreadable safetensors header"):
        read_safetensors_header(path)


def test_non_safetensors_files_are_refused_with_a_true_reason(tmp_path):
    model = nn.Sequential()
    model.add_module("layer", KbitLinear(64, 32, bits=4))
    path = tmp_path / "pytorch_model.bin"
    torch.save(model.state_dict(), path)
    with pytest.raises(KbitCheckpointError, match=r"pytorch_model\.bin: kbit checkpoints are safetensors only.*"
                       r"save_pretrained.*kbit-convert") as info:
        validate_files([path], model)
    assert "quantization_config" not in str(info.value)
    validate_files([path], nn.Sequential(nn.Linear(4, 4)))  # no kbit module: not this check's business


# A Qwen3-MoE tiny model (tests/tiny_models.py, seed 7) quantized on load at k = 3 (down
# projections k = 5) and saved by hf-kbit 0.1's absmax quantizer: format v1 checkpoints must keep
# loading to the same model whatever the quantizer writes today. Its logits on the CPU reference,
# computed in float32 (`logits`), and hf-kbit 0.1's own bf16 forward when it wrote the checkpoint
# (`logits_bf16`). A bf16 forward is no reference across machines: the CPU's bf16 matmuls round
# differently by instruction set (AVX2 against AVX-512: 0.03 apart at the logits here).
V1_CHECKPOINT = Path(__file__).parent / "data" / "kbit_v1_qwen3_moe"
V1_LOGITS_ATOL = 1e-4  # float32 against float32: only reduction order may differ
# float32 against the bf16 forward: its rounding over two layers (0.023 measured); moving one level of
# layer 0's q_proj codebook by 0.05 (-0.096 -> -0.15) moves the logits by 0.19.
V1_BF16_LOGITS_ATOL = 0.1


def test_a_format_v1_checkpoint_loads_to_its_logits():
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import hf_kbit  # noqa: F401  (registers the kbit quantizer)

    expected = load_file(V1_CHECKPOINT / "expected_logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(V1_CHECKPOINT, dtype=torch.float32)
    assert model.config.quantization_config.to_dict()["format_version"] == 1
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits.float()
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=V1_LOGITS_ATOL)
    torch.testing.assert_close(logits, expected["logits_bf16"], rtol=0, atol=V1_BF16_LOGITS_ATOL)
