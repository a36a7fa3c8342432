"""CUDA C sources of cuonline, shipped as package data and compiled at run time."""
