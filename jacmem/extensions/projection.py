"""BatchGradProjection: per-sample gradients projected to a few dimensions, for
training-data attribution (:mod:`jacmem.derivatives.projection` gives the rule)."""

from __future__ import annotations

from jacmem.derivatives.projection import DRAWN, GradProjection
from jacmem.extensions.firstorder import FirstOrderExtension


class BatchGradProjection(FirstOrderExtension):
    """Each sample's gradient projected to ``dim`` dimensions, ``param.grad_proj``:
    ``[N, dim]`` per parameter, scaled as ``grad_batch`` (the loss as reduced).

    ``kind="kronecker"`` (LoGra): the layer's input and output-gradient factors are
    projected apart, ``vec(P_out G_n P_inᵀ)``, for nn.Linear, HF Conv1D, Embedding (rows
    gathered), convolutions and tied weights (summed over their uses), LoRA adapters
    included, never forming ``[N, *p.shape]``; every other parameter takes the dense rule.
    ``kind="dense"`` (TRAK): ``R vec(G_n)`` for every parameter, ``R`` drawn in column
    blocks. The matrices come from ``(seed, the parameter's stable name)``: the same on
    every rank, device, batch split and process, under DDP, FSDP2 and ``torch.compile``.
    ``jacmem.explain()`` names what ran per parameter (``kronecker``, or per-sample
    gradients reduced by the dense rule)."""

    savefield = "grad_proj"
    #: the class names its quantity (the support table reads it); an instance holds it with
    #: its parameters
    quantities = (GradProjection.name,)

    def __init__(self, dim: int, kind: str = "kronecker", seed: int = 0):
        self.quantity = GradProjection(dim=dim, kind=kind, seed=seed)
        self.quantities, self.as_is = (self.quantity,), self.quantity

    @staticmethod
    def clear_matrices() -> None:
        """Let go of the matrices kept between steps (up to
        ``jacmem.derivatives.projection.CACHE_BYTES``, on the devices they were asked on):
        the next step draws them again, the same numbers."""
        DRAWN.clear()

    def finalize(self, q, batch_size):
        return q[self.quantity]

    def __repr__(self) -> str:
        q = self.quantity
        return f"BatchGradProjection(dim={q.dim}, kind={q.kind!r}, seed={q.seed})"
