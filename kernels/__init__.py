"""Triton kernels for the GPU and one C kernel for CPU decode attention, each beside its plain-torch reference."""
