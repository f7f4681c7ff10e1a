"""What a layer is: per-parameter derivatives and Jacobians, pure functions of tensors.

:mod:`.registry` holds the tables and how to add to them; each layer family's file
registers its layers on import. This package imports torch, einops and opt_einsum, and
no other jacmem code.
"""

# The layer families register themselves on import.
from jacmem.derivatives import attention, conv, conv_transpose, embedding, generic, linear, normalization, rnn
from jacmem.derivatives.registry import (
    QUANTITIES,
    REGISTRY,
    Cost,
    Kronecker,
    LayerDerivatives,
    Strategy,
    all_strategy_names,
    detached,
    forward_of,
    layer,
    lookup,
    qualified_name,
    recognised,
    register,
    registered_type,
    stands_for,
)

__all__ = [
    "QUANTITIES",
    "REGISTRY",
    "Cost",
    "Kronecker",
    "LayerDerivatives",
    "Strategy",
    "all_strategy_names",
    "attention",
    "conv",
    "conv_transpose",
    "detached",
    "embedding",
    "forward_of",
    "generic",
    "layer",
    "linear",
    "lookup",
    "normalization",
    "qualified_name",
    "recognised",
    "register",
    "registered_type",
    "rnn",
    "stands_for",
]
