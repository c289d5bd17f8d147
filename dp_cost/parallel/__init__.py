"""Training over several ranks (torchrun): which rank this is, and how each trainer's model and
gradients are spread over the ranks (DDP, FSDP2)."""
