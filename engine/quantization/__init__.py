"""Weights kept quantized: 4-bit (AWQ, GGUF Q4_0/Q4_1) and 8-bit (GGUF Q8_0) linear layers that
multiply without a dense copy, and the conversions of each format into one packed layout.
See docs/quantization.md.

Nothing here imports engine/models/ (the loaders use this package, not the other way round);
``kvpilot quantize``, which needs both, lives above them in engine/awq_writer.py.
"""
