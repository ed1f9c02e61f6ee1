"""The CUDA worker: one stage on an NVIDIA GPU through CuPy (``worker.CudaWorker``), with
kernels of our own (``kernels/*.cu``, loaded by ``kernels.KernelSet``), its device
backend (``device_stage``) and sampling on the device (``device_sampling``). The forward
pass it runs is ``runtime_cupy.program``, written once over a backend, and the worker
interface logic is ``runtime_cupy.stage_worker``, both shared with the other workers
that keep weights as stored. Nothing here imports CuPy at import time."""
