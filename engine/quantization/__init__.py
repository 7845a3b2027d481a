"""Weights kept quantized: 4-bit (AWQ, GGUF Q4_0/Q4_1) and 8-bit (GGUF Q8_0) linear layers that
multiply without a dense copy, the loaders' conversions into one packed layout, and the
``kvpilot quantize`` writer. See docs/quantization.md.

Nothing is imported here: ``kvpilot --help`` imports this package's cli module and must not load torch.
"""
