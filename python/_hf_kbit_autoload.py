"""Registers hf-kbit with transformers without `import hf_kbit` (loaded by hf_kbit_autoload.pth).

transformers has no plugin discovery: a checkpoint whose quant_method it does not know is
loaded with random weights and only a warning. This hook makes that impossible for kbit
checkpoints once hf-kbit is installed. It costs nothing at interpreter start (stdlib only):
it waits for `transformers.quantizers.auto` to be imported, then registers the "kbit"
config and quantizer from hf_kbit; and for `transformers.modeling_utils`, then registers the
"kbit_decode" attention (hf_kbit.attention), which `import hf_kbit` cannot do while
transformers is importing it from here.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# module -> (hf_kbit module, function) to call once the module's code has run
_TARGETS = {
    "transformers.quantizers.auto": ("hf_kbit._register", "register"),
    "transformers.modeling_utils": ("hf_kbit.attention", "register"),
}


def _register(target):
    module, function = _TARGETS[target]
    getattr(importlib.import_module(module), function)()


class _KbitRegistrationFinder(importlib.abc.MetaPathFinder):
    def __init__(self, target):
        self.target = target

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # one shot: find the real module, then step aside
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register(name)

        spec.loader.exec_module = exec_then_register
        return spec


for _target in _TARGETS:
    if _target in sys.modules:  # transformers was imported before this hook (unusual): register now
        _register(_target)
    else:
        sys.meta_path.insert(0, _KbitRegistrationFinder(_target))
