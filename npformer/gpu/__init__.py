"""The GPU tier: what only CuPy runs.

* :mod:`.gemm`: matrix products through cuBLAS, which a CUDA graph can capture;
* :mod:`.attention`: attention's dense statements with those products, and its softmax
  as one CUDA kernel each way (the fast tier's attention hands a captured step to it);
* :mod:`.cuda_graph`: a whole training update captured once and replayed as a CUDA graph.

Nothing here runs on NumPy: on the CPU :func:`.gemm.matmul` is ``a @ b``.
"""
