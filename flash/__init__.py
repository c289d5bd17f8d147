"""Flash Clipping: exact per-sample gradient norms and clipped gradients for DP-SGD from one
backward pass (engine.FlashClipping), by per-layer-type norm rules (rules/) and, on CUDA, fused
Triton kernels (kernels/)."""
