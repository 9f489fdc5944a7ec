"""Buffer precision: which buffers must stay in which dtype, and keeping them there.

``declared``: the dtype each buffer must keep, as data (defaults: BatchNorm statistics, transformers'
``_keep_in_fp32_modules_strict`` / ``_keep_in_fp32_modules``; explicit declarations on top), read by the report,
the doctor and the tools that keep them.

``keep``: :func:`keep_precision`, which keeps declared buffers in their dtype through module casts and DeepSpeed's
bf16 / fp16 engine, and lets a kept BatchNorm run with 16-bit weights.
"""
