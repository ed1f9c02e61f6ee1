"""The CUDA worker: one stage on an NVIDIA GPU through CuPy (``worker.CudaWorker``), with
kernels of our own (``kernels/*.cu``, loaded by ``kernels.KernelSet``) and its device
backend (``device_stage``). What it shares with the other workers that keep weights as
stored lives beside this package: the forward pass written once over a backend
(``runtime_cupy.program``), the worker interface logic (``runtime_cupy.stage_worker``)
and the reference sampler's choice made where the logits are
(``runtime_cupy.device_sampling``). Nothing here imports CuPy at import time."""
