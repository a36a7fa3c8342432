"""The pure description of cuonline's CUDA kernels: the family registry (:mod:`.families`),
the attention options (:mod:`.features`), the specs, planners, argument builders, kernel text
and the pure parts of ``tune``. No CuPy (not even lazily), no engine, no I/O beyond reading
the kernel text."""
