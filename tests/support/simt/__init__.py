"""A SIMT emulator for our CUDA kernels on the CPU (tests only): ``simt.h`` (CUDA's
device API over fibers) and ``loader.compile_cu`` (g++, a cache, launches on NumPy
arrays)."""
