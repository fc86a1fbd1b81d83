"""fused: fused CPU, CUDA C++ and Triton kernels for PyTorch, registered as torch.ops.fused.*."""

# isort: skip_file  (fused._C loads first; the families before the modules built on them)
from fused import (  # noqa: E402
    _ext,  # noqa: F401  loads fused._C: schemas and C++ kernels
    amp,
    nn,
    optim,
)
from fused._backend import get_backend, set_backend
from fused.clip import clip_grad_norm_
from fused.distance import chamfer_distance, pairwise_distances, pairwise_topk, radius_neighbors
from fused.elementwise import bias_act, bias_dropout_add, glu, unary_chain
from fused.linear import linear_act
from fused.loss import cross_entropy, linear_cross_entropy, linear_distillation_loss, linear_log_probs
from fused.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from fused.patch import patch  # the function; the module stays sys.modules["fused.patch"]
from fused.rope import rope

__version__ = "0.1.0"

__all__ = [
    "bias_act",
    "glu",
    "bias_dropout_add",
    "unary_chain",
    "linear_act",
    "nn",
    "pairwise_distances",
    "pairwise_topk",
    "radius_neighbors",
    "chamfer_distance",
    "rms_norm",
    "layer_norm",
    "add_rms_norm",
    "add_layer_norm",
    "rope",
    "linear_cross_entropy",
    "cross_entropy",
    "linear_log_probs",
    "linear_distillation_loss",
    "clip_grad_norm_",
    "optim",
    "amp",
    "set_backend",
    "get_backend",
    "patch",
]
