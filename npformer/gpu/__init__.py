"""The GPU tier, what only CuPy runs: :mod:`.gemm` (cuBLAS products a CUDA graph can
capture), :mod:`.attention` (attention with those products, its softmax one CUDA kernel
each way) and :mod:`.cuda_graph` (a training update captured once and replayed).  Nothing
here runs on NumPy: on the CPU :func:`.gemm.matmul` is ``a @ b``.
"""
