"""hf_kbit.eval stays out of ``import hf_kbit``, and hqq stays out of hf_kbit.eval until an HQQ anchor runs."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import hf_kbit
assert not [m for m in sys.modules if m.startswith("hf_kbit.eval")], "import hf_kbit imported hf_kbit.eval"
from hf_kbit.eval import anchors, corpus, harness, perplexity, variants
assert "hqq" not in sys.modules, "hf_kbit.eval imported hqq at module level"
"""


def test_eval_is_optional_and_lazy():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
