"""Second-order extensions: GGN and Hessian diagonals, KFAC/KFLR/KFACEF/KFRA, EK-FAC, GGN square
roots, block curvature-matrix products (BackPACK 1.7.1 names, attributes, shapes and
scaling). The engine is :mod:`jacmem.engine.secondorder.engine`."""

from jacmem.extensions.secondorder.base import SecondOrderExtension
from jacmem.extensions.secondorder.curvmatprod import GGNMP, HMP, PCHMP
from jacmem.extensions.secondorder.diag_ggn import BatchDiagGGNExact, BatchDiagGGNMC, DiagGGNExact, DiagGGNMC
from jacmem.extensions.secondorder.diag_hessian import BatchDiagHessian, DiagHessian
from jacmem.extensions.secondorder.ekfac import EKFAC
from jacmem.extensions.secondorder.kfac import KFAC, KFACEF, KFLR, KFRA
from jacmem.extensions.secondorder.sqrt_ggn import SqrtGGNExact, SqrtGGNMC

__all__ = [
    "SecondOrderExtension",
    "DiagGGNExact",
    "DiagGGNMC",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "DiagHessian",
    "BatchDiagHessian",
    "KFAC",
    "KFACEF",
    "EKFAC",
    "KFLR",
    "KFRA",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "GGNMP",
    "HMP",
    "PCHMP",
]
