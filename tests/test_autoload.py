"""The .pth hook (python/_hf_kbit_autoload.py), each case in a fresh interpreter.

The interpreters start with ``-S`` and a sys.path of this checkout's hook, this checkout and the
current environment's site-packages, so they test this source of the hook whatever copy an
install put into site-packages (and no other .pth runs).
"""

from __future__ import annotations

import filecmp
import json
import site
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOOK = REPO / "python" / "_hf_kbit_autoload.py"


def run_fresh(code: str, hook: bool = True) -> dict:
    """Run ``code`` in a fresh interpreter (hook installed first when ``hook``); return its JSON ``result``."""
    paths = [str(REPO / "python"), str(REPO), *site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    prelude = f"import json, sys\nsys.path[:0] = {paths!r}\n"
    if hook:
        prelude += "import _hf_kbit_autoload\n"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"fresh interpreter failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hook_imports_nothing_but_itself():
    result = run_fresh(
        """
        before = set(sys.modules)
        import _hf_kbit_autoload
        print(json.dumps(sorted(set(sys.modules) - before)))
        """,
        hook=False,
    )
    assert result == ["_hf_kbit_autoload"]


@pytest.mark.parametrize(
    "statement",
    [
        "import transformers.quantizers",
        "import transformers.integrations",
        "from transformers.integrations import bitsandbytes",
        "import transformers",
        "from transformers import AutoModelForCausalLM",
    ],
)
def test_importing_transformers_first_works_and_leaves_hf_kbit_unimported(statement):
    result = run_fresh(
        f"""
        {statement}
        print(json.dumps("hf_kbit" in sys.modules))
        """
    )
    assert result is False


def test_kbit_quant_method_resolves_without_import():
    result = run_fresh(
        """
        from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig
        imported_before = "hf_kbit" in sys.modules
        config = AutoQuantizationConfig.from_dict({"quant_method": "kbit", "bits": 3})
        quantizer = AutoHfQuantizer.from_config(config, pre_quantized=True)
        print(json.dumps([imported_before, type(config).__module__, config.bits, type(quantizer).__module__]))
        """
    )
    assert result == [False, "hf_kbit.config", 3, "hf_kbit.quantizer"]


def test_plain_model_does_not_import_hf_kbit():
    result = run_fresh(
        """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2)
        model = LlamaForCausalLM(config)
        model(torch.zeros(1, 4, dtype=torch.long))
        print(json.dumps("hf_kbit" in sys.modules))
        """
    )
    assert result is False


def test_kbit_decode_attention_known_without_import_and_matches_sdpa():
    result = run_fresh(
        """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        known = "kbit_decode" in ALL_ATTENTION_FUNCTIONS.valid_keys()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2)
        model = LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 64, (1, 5))
        with torch.no_grad():
            ref = model(ids).logits
            model.set_attn_implementation("kbit_decode")
            imported_before_forward = "hf_kbit" in sys.modules
            out = model(ids).logits
        print(json.dumps([known, imported_before_forward, "hf_kbit" in sys.modules, (out - ref).abs().max().item()]))
        """
    )
    known, imported_before_forward, imported_after, max_diff = result
    assert known and not imported_before_forward and imported_after
    assert max_diff < 1e-5


def test_installed_hook_is_this_source():
    installed = [Path(p) / HOOK.name for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]}]
    installed = [p for p in installed if p.is_file()]
    if not installed:
        pytest.skip("hf-kbit's .pth hook is not installed in this environment")
    assert filecmp.cmp(installed[0], HOOK, shallow=False), (
        f"{installed[0]} differs from {HOOK}: reinstall hf-kbit (scripts/_venv.sh does when the hook changes)"
    )


def test_kbit_checkpoint_loads_without_import(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hf_kbit

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "bf16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=hf_kbit.KbitConfig(bits=4))
    model.save_pretrained(tmp_path / "kbit")
    ids = torch.arange(8)[None]
    with torch.no_grad():
        expected = model(ids).logits[0, -1].tolist()
    result = run_fresh(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "kbit")!r})
        with torch.no_grad():
            logits = model(torch.arange(8)[None]).logits[0, -1].tolist()
        print(json.dumps([type(model.model.layers[0].mlp.down_proj).__name__, logits]))
        """
    )
    assert result[0] == "KbitLinear"
    assert result[1] == pytest.approx(expected, abs=0)
