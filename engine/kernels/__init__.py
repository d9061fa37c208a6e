"""Optional fast paths: Triton kernels, compiled layers, CUDA graphs, flash-linear-attention dispatch."""
