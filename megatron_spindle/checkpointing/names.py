"""One name per full tensor whatever the layer spec: megatron-core's local-spec spelling.

Transformer Engine's spec fuses the two pre-norms into the next linear (``...self_attention.linear_qkv.
layer_norm_weight``); ``local_spelling`` names those as the local spec's norms (``...input_layernorm.weight``), so
that checkpoints, the runtime's keys and the reference model share one name per tensor whichever spec built the
layers (``--attention-backend local`` builds the local spec on a machine with TE). ``to_te_names`` /
``from_te_names`` convert whole dicts (the checkpoint converters' ``--layer-names``). Pure Python: checkpoint readers
import it without megatron-core.
"""

from __future__ import annotations

# local-spec name (suffix after "<unit>.") -> Transformer Engine spec name
TE_SPELLINGS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
_LOCAL_SPELLINGS = {te: local for local, te in TE_SPELLINGS.items()}


def _respelled(name: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        if name.endswith("." + old):
            return name[: -len(old)] + new
    return name


def local_spelling(name: str) -> str:
    """A full tensor's name in the local spec's spelling (Transformer Engine's fused pre-norm names renamed)."""
    return _respelled(name, _LOCAL_SPELLINGS)


def to_te_names(tensors: dict) -> dict:
    """Local-spec tensor names -> Transformer Engine spec names (fused pre-norms)."""
    return {_respelled(k, TE_SPELLINGS): v for k, v in tensors.items()}


def from_te_names(tensors: dict) -> dict:
    """Transformer Engine spec names -> local-spec names; other names unchanged."""
    return {local_spelling(k): v for k, v in tensors.items()}
