"""What autograd keeps for the backward pass, and how to keep less.

* :func:`report` runs a forward pass and lists the tensors autograd saves, by module
  and by op, with the ``requires_grad`` they are kept for and suggestions.
* :func:`lean` / :func:`unlean` swap stock layers for ones that keep only what the
  current ``requires_grad`` pattern needs (and back).
* :class:`BatchNormAct`: BatchNorm + LeakyReLU keeping only its output.
* :func:`peak_memory`: measured peak memory of a call, CPU or CUDA.
"""

from jacmem.memory.fused import BatchNormAct
from jacmem.memory.lean import LEAN, lean, unlean
from jacmem.memory.measure import peak_memory
from jacmem.memory.report import MemoryReport, report

__all__ = ["report", "MemoryReport", "lean", "unlean", "LEAN", "BatchNormAct", "peak_memory"]
