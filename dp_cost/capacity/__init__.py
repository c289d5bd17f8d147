"""--mode=capacity: the capacity planner. A config's step run on fake tensors (no GPU), torch's
caching allocator replayed over its requests, and the searches for the largest physical batch
and the longest sequence that fit a card (predicted, or found by runs)."""
