"""Training-data attribution: which training examples made the model do this.

:class:`Influence` scores training examples against queries with influence functions
(EK-FAC, KFAC, diagonal or no curvature) on the per-sample gradients of
:class:`jacmem.BatchGrad`; :class:`GradientStore` keeps the training gradients on disk,
in chunks, memory-mapped and resumable; :class:`TRAK` gives TRAK's scores (gradients of
the output function, here :func:`margin`, with its Gauss-Newton kernel).
"""

from jacmem.attribution.influence import Influence
from jacmem.attribution.store import GradientStore
from jacmem.attribution.trak import TRAK, margin

__all__ = ["Influence", "TRAK", "margin", "GradientStore"]
