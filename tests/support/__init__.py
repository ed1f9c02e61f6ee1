"""What only tests and benchmarks import: the CUDA kernels' NumPy twins and the twin
stage, the emulated CuPy, the in-process chain of workers, random-model writers, and
the test stage host that injects faults through the host port."""
