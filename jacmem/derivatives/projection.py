"""Random projections of per-sample gradients (training-data attribution: TRAK, LoGra):
the generation rule and the quantity ``grad_proj``, ``[N, dim]`` per parameter. Layer-free:
the layer files register the strategies that compute it without per-sample gradients
(``kronecker``, in :mod:`.linear`, :mod:`.embedding`, :mod:`.conv`).

**The rule.** Every matrix is :func:`matrix` ``(seed, name, rows, cols)``: entries drawn from
N(0, 1/rows), in float64, by a CPU ``torch.Generator`` seeded from a stable 64-bit hash of
``f"{seed}:{name}"`` (BLAKE2b, never Python's ``hash``), then cast and moved. So a
parameter's matrices are the same on every rank, device, batch split and process.
``name`` is the parameter's stable name: its qualified name in the user's model, without
wrappers (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP's), the first name of
a tied parameter (as ``model.named_parameters()`` lists it).

* ``kind="kronecker"`` (LoGra), for a weight whose per-sample gradient is a matrix
  ``G_n [R, C]`` as the weight is stored (nn.Linear's ``[O, I]``; HF Conv1D's ``[I, O]``;
  an Embedding's ``[V, d]``; a convolution's ``[C_out, C_in/groups · prod(kernel)]``, its
  kernel axes flattened): with ``(P_rows [k_rows, R], P_cols [k_cols, C]) =
  kronecker(seed, name, dim, R, C)`` (``(k_rows, k_cols) = factors(dim)``),
  ``grad_proj[n] = vec(P_rows G_n P_colsᵀ)``, row-major ``[k_rows, k_cols]``. As ``G_n`` is
  a sum of outer products of a layer's output gradients and inputs (``Σ_t g_t x_tᵀ`` for
  Linear, ``Σ_t x_t g_tᵀ`` for Conv1D, ``Σ_t e_{i_t} g_tᵀ`` for an Embedding), the layers
  project each side and sum ``Σ_t (P_rows ·)(P_cols ·)ᵀ``, never forming ``G_n``: an
  Embedding gathers the columns of ``P_rows`` at its ids. The stored layout, not a layer's
  roles, orders the two sides, so that a weight tied between an Embedding ``[V, d]`` and an
  LM head (a Linear ``[V, d]``) is one linear map of its summed gradient. (A layer whose
  Kronecker factors are those of ``weight.T``, :class:`~jacmem.derivatives.Kronecker`'s
  ``transposed``, has its input side on the rows: ``P_in = P_rows``.)
* ``kind="dense"`` (TRAK's Johnson–Lindenstrauss projection), and the kronecker kind on a
  parameter without a kronecker strategy (a bias, a norm's scale, a parameter used
  directly): ``grad_proj[n] = R vec(G_n)``, ``R [dim, P]`` in column blocks of
  :data:`BLOCK_COLUMNS`, block ``b`` (columns ``b·B ..``) drawn as
  ``matrix(seed, f"{name}:{b}", dim, B)`` (the last block narrower); never ``[dim, P]`` whole.

``E‖grad_proj[n]‖² = ‖G_n‖²`` under either kind. The quantity is linear (a tied
parameter's is the sum over its uses: one name, one matrix) and of degree 1.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict

import torch
from torch import Tensor

from jacmem.derivatives.quantities import Quantity, quantity

#: the columns of one block of the dense rule's matrix (part of the rule: fixed)
BLOCK_COLUMNS = 4096
KINDS = ("kronecker", "dense")


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from ``f"{seed}:{name}"``, the same in every process (BLAKE2b)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


#: the bytes of drawn matrices kept between steps (:class:`Drawn`): a GPT-2's (12 layers, d =
#: 768, 50k tied vocabulary) at dim 256 take 131 MiB in float32
CACHE_BYTES = 256 * 2**20


class Drawn:
    """The matrices drawn lately, at most ``limit`` bytes: a read-only cache of
    :func:`matrix` (the same arguments give the same matrix), so that a warm step draws
    nothing where the model's matrices fit. Drawing is the cost it saves (float64 normals,
    about 30 ns each on a CPU core: a GPT-2's biases and norms alone take 31 M of them at
    dim 256, a second per step).

    A step asks for every matrix once or twice (a tied weight), in the same order every
    step: least recently used first out, a model with more than ``limit`` would let go of
    each matrix just before it is asked again, and draw them all at every step. So an entry
    is let go for a new one only when stale, not asked in the last ``STALE · len(kept)``
    asks (another model's, another seed's); else the new one is not kept, and the cache
    keeps serving the part of the model it holds."""

    STALE = 4

    def __init__(self, limit: int):
        self.limit, self.bytes, self.asked = limit, 0, 0
        #: key -> (matrix, the ask that last asked for it), least recently asked first
        self.kept: OrderedDict[tuple, tuple[Tensor, int]] = OrderedDict()
        self.lock = threading.Lock()  # (backward hooks may run on autograd's device threads)

    def get(self, key: tuple) -> Tensor:
        with self.lock:
            self.asked += 1
            found = self.kept.get(key)
            if found is not None:
                self.kept[key] = (found[0], self.asked)
                self.kept.move_to_end(key)
                return found[0]
        seed, name, rows, cols, dtype, device = key
        gen = torch.Generator().manual_seed(stable_seed(seed, name))
        drawn = torch.randn(rows, cols, generator=gen, dtype=torch.float64).div_(math.sqrt(rows))
        drawn = drawn.to(dtype=dtype, device=device)
        with self.lock:
            if key not in self.kept:
                self._keep(key, drawn)
        return drawn

    def clear(self) -> None:
        """Let go of every matrix kept (the next step draws them again, the same numbers)."""
        with self.lock:
            self.kept.clear()
            self.bytes = 0

    def _keep(self, key: tuple, drawn: Tensor) -> None:
        """Keep ``drawn`` where stale entries make room enough for it (then they go)."""
        need, stale, gone = self.bytes + drawn.nbytes - self.limit, self.asked - self.STALE * len(self.kept), []
        for k, (old, last) in self.kept.items():
            if need <= 0 or last > stale:
                break
            gone.append(k)
            need -= old.nbytes
        if need > 0:
            return
        for k in gone:
            self.bytes -= self.kept.pop(k)[0].nbytes
        self.kept[key], self.bytes = (drawn, self.asked), self.bytes + drawn.nbytes


#: the process's :class:`Drawn` (a cache of a pure function: it decides no result)
DRAWN = Drawn(CACHE_BYTES)


def matrix(seed: int, name: str, rows: int, cols: int, *, dtype: torch.dtype, device) -> Tensor:
    """``[rows, cols]``, entries N(0, 1/rows) drawn from ``(seed, name)`` (module docstring).
    Kept while they fit in :data:`CACHE_BYTES` (:class:`Drawn`); read-only."""
    return DRAWN.get((int(seed), str(name), int(rows), int(cols), dtype, torch.device(device)))


def factors(dim: int) -> tuple[int, int]:
    """The most balanced ``(k_rows, k_cols)`` with ``k_rows · k_cols == dim``,
    ``k_rows <= k_cols`` (``256 -> (16, 16)``, ``8 -> (2, 4)``, a prime ``p -> (1, p)``)."""
    k_rows = max(d for d in range(1, math.isqrt(dim) + 1) if dim % d == 0)
    return k_rows, dim // k_rows


def kronecker(
    seed: int, name: str, dim: int, rows: int, cols: int, *, dtype: torch.dtype, device
) -> tuple[Tensor, Tensor]:
    """``(P_rows [k_rows, rows], P_cols [k_cols, cols])`` of the kronecker kind for a weight
    stored ``[rows, cols]``: ``matrix(seed, name + ":rows", ...)`` and ``matrix(seed, name +
    ":cols", ...)``, ``(k_rows, k_cols) = factors(dim)``."""
    k_rows, k_cols = factors(dim)
    p_rows = matrix(seed, name + ":rows", k_rows, rows, dtype=dtype, device=device)
    return p_rows, matrix(seed, name + ":cols", k_cols, cols, dtype=dtype, device=device)


def dense(flat: Tensor, seed: int, name: str, dim: int) -> Tensor:
    """The dense rule ``R vec(G_n)``, block of columns by block: ``[n, P] -> [n, dim]``."""
    out = flat.new_zeros(flat.shape[0], dim)
    for b, start in enumerate(range(0, flat.shape[1], BLOCK_COLUMNS)):
        block = flat[:, start : start + BLOCK_COLUMNS]
        out.addmm_(block, matrix(seed, f"{name}:{b}", dim, block.shape[1], dtype=flat.dtype, device=flat.device).T)
    return out


def outer_sum(u: Tensor, w: Tensor) -> Tensor:
    """``Σ_t u_t w_tᵀ`` per sample, flattened row-major: ``[N, T, k_rows]``, ``[N, T, k_cols]``
    -> ``[N, k_rows·k_cols]``: the kronecker kind from the projected sides."""
    return torch.bmm(u.transpose(1, 2), w).flatten(1)


@quantity
class GradProjection(Quantity):
    """Per-sample gradients projected to ``dim`` by the rule of ``kind`` drawn from ``seed``
    (module docstring): ``[N, dim]``."""

    name, parameters, spelled = "grad_proj", ("dim", "kind", "seed"), "[N, dim]"
    per_sample, linear, degree, named, exclusive = True, True, 1, True, True

    def __new__(cls, **params):
        self = super().__new__(cls, **params)
        dim, kind, seed = params["dim"], params["kind"], params["seed"]
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"grad_proj: dim must be a positive integer, got {dim!r}")
        if kind not in KINDS:
            raise ValueError(f"grad_proj: unknown kind {kind!r}; valid: {', '.join(KINDS)}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"grad_proj: seed must be an integer, got {seed!r}")
        return self

    def shape(self, n, param_shape):
        return (n, self.dim)

    def from_batch_grad(self, batch_grad, name=None):
        """The dense rule on (a chunk of) per-sample gradients ``[n, *p.shape]`` -> ``[n, dim]``."""
        return dense(batch_grad.reshape(batch_grad.shape[0], -1), self.seed, name, self.dim)
