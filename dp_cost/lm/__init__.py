"""The causal decoder LM the profiler trains (``model.py``): named configs, built with random
weights."""
