"""The Gaussian samplers DP noise is drawn from, as the discrete laws they are: each sampler's
support and the chance a neighbour's output leaves it (laws.py), and the 64-bit Box-Muller
transform in torch operations (exact64.py), the CPU twin of flash's Triton kernel."""
