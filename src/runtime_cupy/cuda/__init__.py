"""The CUDA worker: one stage on an NVIDIA GPU through CuPy (``worker.CudaWorker``), with
kernels of our own (``kernels/*.cu``, loaded by ``kernels.KernelSet``) and its device
backend (``backend``). What it shares with the other workers that keep weights as
stored lives in ``runtime_core.workers``: the forward pass written once over a backend
(``forward_program``), the worker interface logic (``stage_worker``) and the reference
sampler's choice made where the logits are (``device_sampling``). Nothing here imports
CuPy at import time."""
