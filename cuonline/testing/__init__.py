"""Testing helpers for cuonline.

``cuonline.testing.emulate`` compiles the CUDA kernel text with the C++ compiler and a
CUDA-emulation header (``cuda_cpu.h``) and runs it on NumPy arrays, so the CUDA engine can be
tested on machines without a GPU.  Nothing is imported or compiled until it is used.
"""
