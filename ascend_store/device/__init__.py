"""The device layer (CUDA, Ascend NPU, CPU) and the batched device copy path with its kernels."""
