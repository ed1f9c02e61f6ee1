"""The CUDA worker: one stage on an NVIDIA GPU through CuPy (``worker.CudaWorker``), with
kernels of our own (``kernels/*.cu``, loaded by ``kernels.KernelSet``), the forward pass
written once over a backend (``program``), its device backend (``device_stage``) and
sampling on the device (``device_sampling``). Nothing here imports CuPy at import time."""
