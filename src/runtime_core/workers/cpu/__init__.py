"""The CPU worker: quantized weights mapped from the file, compiled kernels
(``worker.CpuWorker``)."""
