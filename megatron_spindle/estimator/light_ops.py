"""The light operators of a workload (front ends, projectors, heads, LM head, contrastive loss): their GEMMs and
their memory-bound traffic, for the kernel model. They always run with tp = 1 (estimator/configs.py)."""

from __future__ import annotations

from megatron_spindle.estimator.errors import EstimatorError
from megatron_spindle.graph.opgraph import MetaOp
from megatron_spindle.graph.workload import ModuleSpec

# Backward costs twice the forward (gradients w.r.t. inputs and w.r.t. weights): fwd + bwd = 3x the forward's
# FLOPs, and an element-wise pass runs once forward and about twice backward.
FWD_BWD_FACTOR = 3


def vocab_of(metaop: MetaOp, module: ModuleSpec) -> int:
    if not module.lm_vocab:
        raise EstimatorError(f"MetaOp '{metaop.id}': lm_head on module '{module.name}' without a vocab_size")
    return module.lm_vocab


def embed_of(module: ModuleSpec) -> int:
    return module.embed_dim or module.hidden_size


def light_gemms(metaop: MetaOp, module: ModuleSpec | None, rows: int) -> list[tuple[float, float, float]]:
    """Forward GEMMs (m, n, k) of a light operator on a DP rank holding ``rows`` samples (``module``: None for
    the loss)."""
    _, s, x = metaop.input_shape
    if metaop.kind == "loss":
        return [(rows, metaop.batch, x)]  # local embeddings against the gathered batch
    h = module.hidden_size
    if metaop.kind == "frontend":
        fe = module.frontend
        if fe is None or fe.type == "text":
            return []
        if fe.stem == "conv":  # conv1 (k3) at the frame rate, conv2 (k3) per token, as matmuls
            return [(rows * s * fe.patch_size, h, 3 * fe.in_channels), (rows * s, h, 3 * h)]
        k = 2 if fe.type == "patch" else 1  # 2D patches vs 1D windows: the conv is a matmul per patch
        return [(rows * s, h, fe.in_channels * fe.patch_size**k)]
    if metaop.kind == "projector":
        return [(rows * s, h, module.in_size), (rows * s, h, h)]
    if metaop.kind == "head":
        return [(rows, embed_of(module), h)]
    if metaop.kind == "lm_head":
        return [(rows * s, vocab_of(metaop, module), h)]
    raise EstimatorError(f"MetaOp '{metaop.id}': unknown light kind '{metaop.kind}'")


def light_traffic(metaop: MetaOp, module: ModuleSpec | None, dtype_bytes: int, hidden_dropout: bool = False) -> float:
    """HBM bytes of a light operator's memory-bound work for its whole batch, forward + backward; with
    ``hidden_dropout`` a text front end's embedding dropout too (op_kernels.py ``_dropout``, each phase)."""
    d = dtype_bytes
    b, s, _ = metaop.input_shape
    if metaop.kind == "loss":
        return FWD_BWD_FACTOR * 4.0 * b * b * 2  # fp32 softmax over the B x B logits
    h = module.hidden_size
    if metaop.kind == "frontend":
        fe = module.frontend
        if fe is not None and fe.type == "text":
            # Gather rows (read + write) forward; backward reads the gradient and scatter-adds into the fp32
            # embedding gradient (read + write 4 bytes).
            return b * s * h * (3 * d + 8.0 + (2 * (2 * d + 1) if hidden_dropout else 0))
        passes = 3 + (2 if fe is not None and fe.pre_norm else 0)  # bias, position add, layout copy, norm
        if fe is not None and fe.stem == "conv":  # two GELUs (read + write), conv1's at the frame rate
            passes += 2 * fe.patch_size + 2
        return FWD_BWD_FACTOR * d * b * s * h * passes
    if metaop.kind in ("projector", "head"):
        # projector: activation read + write, pooling read; head: final norm read + write, pooling read
        return FWD_BWD_FACTOR * d * b * s * h * 3
    if metaop.kind == "lm_head":
        norm = FWD_BWD_FACTOR * d * b * s * h * 2
        cross_entropy = b * s * vocab_of(metaop, module) * (2 * d + 8.0)  # logits, fp32 softmax and grad, grad
        return norm + cross_entropy
    raise EstimatorError(f"MetaOp '{metaop.id}': unknown light kind '{metaop.kind}'")
