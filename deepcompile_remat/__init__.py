"""deepcompile_remat: ZeRO-3-aware min-cut rematerialization for torch.compile.

Importing the package does not import torch; the torch-facing pieces load on first use.
"""
from deepcompile_remat import _C

__version__ = _C.__version__

__all__ = ["__version__"]
