"""Per-device implementations of the ``kbit`` ops (the default backend is the PyTorch reference in ``hf_kbit._ops``)."""
