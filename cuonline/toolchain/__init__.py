"""Tools that compile and read kernel text without a GPU: the NVRTC listing (``python -m
cuonline kernels``, the compile tests) and the SASS reader. They load the NVRTC library and
run ``nvdisasm``, so they live apart from the pure :mod:`cuonline.kernels` description."""
