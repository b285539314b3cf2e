"""hf_kbit.nn.replace: which modules modules_to_not_convert keeps in full precision."""

from __future__ import annotations

import pytest

from hf_kbit.nn.selection import should_convert


@pytest.mark.parametrize(
    "name,entries,expected",
    [
        ("model.layers.1.mlp.down_proj", ["model.layers.1"], False),  # dotted prefix
        ("model.layers.1.mlp.down_proj", ["model.layers.10"], True),  # a prefix only at a dot
        ("model.layers.0.mlp.shared_expert.up_proj", ["shared_expert"], False),  # a name component
        ("model.layers.0.mlp.shared_experts.up_proj", ["shared_expert"], True),  # components are whole
        ("model.layers.3.self_attn.q_proj", [r"model\.layers\.\d+\.self_attn\.q_proj"], False),  # full regex
        ("model.layers.3.mlp.down_proj", [r"model\.layers\.\d+\.mlp"], False),  # a regex naming an ancestor
        ("model.layers.3.mlp.down_proj", [r"layers\.\d+\.mlp"], True),  # regexes match whole names
        ("lm_head", ["lm_head"], False),
    ],
    ids=["prefix", "prefix-at-dot", "component", "whole-component", "regex", "regex-ancestor", "regex-whole",
         "lm_head"],
)
def test_should_convert(name, entries, expected):
    assert should_convert(name, entries) is expected
