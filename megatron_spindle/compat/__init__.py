"""megatron-core compatibility: the CPU shim, layer-spec choice (TE or local), explicit process groups."""

from megatron_spindle.compat.cpu import apply_cpu_shim, layer_spec, te_available

__all__ = ["apply_cpu_shim", "layer_spec", "te_available"]
