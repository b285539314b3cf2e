"""hf_kbit.eval stays out of ``import hf_kbit``, and works without hqq until an HQQ anchor runs.

(transformers itself imports hqq wherever hqq is installed, so the check hides hqq rather than looking for it.)
"""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
sys.modules["hqq"] = None  # as if hqq were not installed: importing it raises ImportError
import hf_kbit
assert not [m for m in sys.modules if m.startswith("hf_kbit.eval")], "import hf_kbit imported hf_kbit.eval"
from hf_kbit.eval import anchors, breakdown, corpus, decode_bench, graph_step, harness, models, perplexity, presets
from hf_kbit.eval import finetune, report, timing, variants
try:
    anchors.require_hqq()
except ImportError as e:
    assert "pip install hf-kbit[eval]" in str(e), e
else:
    raise AssertionError("require_hqq() did not raise without hqq")
"""


def test_eval_is_optional_and_works_without_hqq():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
