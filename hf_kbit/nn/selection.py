"""Which modules of a model kbit converts, and putting a module in another's place (no transformers lifecycle here).

Shared by the Linear swaps (hf_kbit.nn.replace) and the experts swaps (hf_kbit.nn.experts).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn


def should_convert(name: str, modules_to_not_convert: list[str]) -> bool:
    """False when ``name`` or one of its ancestors is listed: a listed entry matches as a full
    dotted path prefix (``model.layers.1``), as whole name components anywhere
    (``shared_expert`` skips ``...mlp.shared_expert.up_proj``), or as a full regex."""
    dotted = f".{name}."
    parts = name.split(".")
    lineage = [".".join(parts[: i + 1]) for i in range(len(parts))]  # "a", "a.b", ..., name
    for key in modules_to_not_convert:
        if name.startswith(key + ".") or f".{key}." in dotted or any(re.fullmatch(key, n) for n in lineage):
            return False
    return True


def tied_modules(model: nn.Module) -> list[str]:
    """Modules whose weight is another module's (transformers' tied weights, e.g. an LM head that
    shares the input embedding's matrix): kbit keeps them in full precision whatever
    ``modules_to_not_convert`` says, because quantizing one would untie it (the embedding stays a
    full-precision lookup table), so the model would hold the matrix twice."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return sorted({key.rpartition(".")[0] for key in tied})


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def swap_modules(
    model: nn.Module, modules_to_not_convert: list[str], make: Callable[[str, nn.Module], nn.Module | None]
) -> list[str]:
    """Put ``make(name, module)`` in the place of every module kbit may convert (``should_convert``)
    for which it returns a module (frozen: kbit tensors are never trained); returns their names."""
    converted = []
    for name, module in list(model.named_modules()):
        if not should_convert(name, modules_to_not_convert):
            continue
        new = make(name, module)
        if new is not None:
            new.requires_grad_(False)
            _set_submodule(model, name, new)
            converted.append(name)
    return converted
