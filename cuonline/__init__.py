"""cuonline: exact FlashAttention-style attention for NumPy and CuPy arrays."""
