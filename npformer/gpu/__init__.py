"""The GPU tier: what only CuPy runs.

* :mod:`.gemm`: matrix products through cuBLAS, which a CUDA graph can capture;
* :mod:`.cuda_graph`: a whole training update captured once and replayed as a CUDA graph.

Nothing here runs on NumPy: on the CPU :func:`.gemm.matmul` is ``a @ b``.
"""
