"""Registers hf-kbit with transformers without `import hf_kbit` (loaded by hf_kbit_autoload.pth).

transformers has no plugin discovery: a checkpoint whose quant_method it does not know is
loaded with random weights and only a warning. This hook makes that impossible for kbit
checkpoints once hf-kbit is installed, and makes attn_implementation="kbit_decode" known.

It must cost nothing to programs that never use kbit, and must never import anything while
transformers' own modules are half initialized. So it imports only `sys`, and once a
transformers registry module has run it only swaps in entries that import hf_kbit on use:

- `transformers.quantizers.auto`: its two quantizer registries become dicts that import
  hf_kbit (which registers "kbit") the first time they are asked for "kbit" or listed;
- `transformers.modeling_utils`: "kbit_decode" is registered with the attention interface as
  a function that imports hf_kbit on its first call;
- `transformers.masking_utils`: "kbit_decode" gets sdpa's mask (as hf_kbit.attention registers).
"""

import sys

QUANT_METHOD = "kbit"
ATTENTION = "kbit_decode"

_importing = False  # hf_kbit is being imported by a lookup: lookups until then are plain


def _import_hf_kbit():
    """Import hf_kbit (its import registers everything) unless that is already under way."""
    global _importing
    if _importing:
        return
    _importing = True
    try:
        import hf_kbit  # noqa: F401
    finally:
        _importing = False


class _KbitOnFirstUse(dict):
    """A quantizer registry that imports hf_kbit before any lookup that could need it:
    a lookup of "kbit", or a listing of the registered names."""

    __slots__ = ()

    def __contains__(self, key):
        if key == QUANT_METHOD:
            _import_hf_kbit()
        return dict.__contains__(self, key)

    def __getitem__(self, key):
        if key == QUANT_METHOD:
            _import_hf_kbit()
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        if key == QUANT_METHOD:
            _import_hf_kbit()
        return dict.get(self, key, default)

    def __iter__(self):
        _import_hf_kbit()
        return dict.__iter__(self)

    def keys(self):
        _import_hf_kbit()
        return dict.keys(self)

    def items(self):
        _import_hf_kbit()
        return dict.items(self)

    def values(self):
        _import_hf_kbit()
        return dict.values(self)


def _quantizer_registries_ready(auto):
    for name in ("AUTO_QUANTIZATION_CONFIG_MAPPING", "AUTO_QUANTIZER_MAPPING"):
        registry = getattr(auto, name, None)
        if type(registry) is dict:
            setattr(auto, name, _KbitOnFirstUse(registry))


def kbit_decode_attention(*args, **kwargs):
    """Stands in for hf_kbit.attention.decode_attention_forward until hf_kbit is imported
    (importing it registers the real function in this one's place)."""
    from hf_kbit.attention import decode_attention_forward

    return decode_attention_forward(*args, **kwargs)


def _attention_registry_ready(modeling_utils):
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is not None:
        interface._global_mapping.setdefault(ATTENTION, kbit_decode_attention)


def _mask_registry_ready(masking_utils):
    masks = getattr(getattr(masking_utils, "AttentionMaskInterface", None), "_global_mapping", None)
    if masks is not None and "sdpa" in masks:
        masks.setdefault(ATTENTION, masks["sdpa"])


_READY = {
    "transformers.quantizers.auto": _quantizer_registries_ready,
    "transformers.modeling_utils": _attention_registry_ready,
    "transformers.masking_utils": _mask_registry_ready,
}


class _AfterImport:
    """Meta path finder that lets the other finders find each target module, then runs its
    `_READY` callback once the module's code has run (and steps aside when none is left).
    A spec found but never executed (an `importlib.util.find_spec` probe) changes nothing."""

    def __init__(self, targets):
        self.targets = set(targets)

    def find_spec(self, name, path=None, target=None):
        if name not in self.targets:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is not self and find is not None:
                spec = find(name, path, target)
                if spec is not None:
                    break
        exec_module = getattr(getattr(spec, "loader", None), "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_ready(module):
            exec_module(module)
            self.targets.discard(name)
            if not self.targets and self in sys.meta_path:
                sys.meta_path.remove(self)
            _READY[name](module)

        spec.loader.exec_module = exec_then_ready
        return spec


def install():
    pending = []
    for name, ready in _READY.items():
        if name in sys.modules:  # transformers was imported before this hook (unusual): swap in now
            ready(sys.modules[name])
        else:
            pending.append(name)
    if pending and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(pending))


install()
