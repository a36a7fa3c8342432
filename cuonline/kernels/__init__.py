"""CUDA kernel variants: specs, heuristics, source text and NVRTC listings (no CuPy imported)."""

from .specs import KernelSpec

__all__ = ["KernelSpec"]
