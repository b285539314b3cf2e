"""Registers hf-kbit with transformers without `import hf_kbit` (loaded by hf_kbit_autoload.pth).

transformers has no plugin discovery: a checkpoint whose quant_method it does not know is
loaded with random weights and only a warning. This hook makes that impossible for kbit
checkpoints once hf-kbit is installed. It costs nothing at interpreter start (stdlib only):
it waits for `transformers.quantizers.auto` to be imported, then registers the "kbit"
config and quantizer from hf_kbit.
"""

import importlib.abc
import importlib.util
import sys

_TARGET = "transformers.quantizers.auto"


class _KbitRegistrationFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot: find the real module, then step aside
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            from hf_kbit._register import register

            register()

        spec.loader.exec_module = exec_then_register
        return spec


if _TARGET in sys.modules:  # transformers was imported before this hook (unusual): register now
    from hf_kbit._register import register

    register()
else:
    sys.meta_path.insert(0, _KbitRegistrationFinder())
