"""megatron-spindle: wavefront scheduling (Spindle, ASPLOS'25) for multi-task multi-modal training."""

__version__ = "0.1.0"
