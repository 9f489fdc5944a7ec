"""Trainer integrations, each importing its framework only when its module is imported:
``zero_buffers.integrations.transformers`` (transformers' ``Trainer``) and ``zero_buffers.integrations.lightning``
(PyTorch Lightning)."""
