"""Online tuning of Triton Inference Server instance counts and dynamic-batching delay."""

__version__ = "0.1.0"
