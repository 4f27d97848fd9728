"""STOF-TRT: fast inference for sparse (masked) Transformers on NVIDIA GPUs.

Public API: mask specs (``stof_trt.masks``), the tile format (``stof_trt.format``), the ONNX rewrite
(``stof_trt.rewrite``) and the ``stof`` command line (``stof_trt.cli``).
"""

from .errors import StofError
from .format import STOF_FORMAT_VERSION, TileClass, TileLayout, compile_mask
from .masks import MaskSpec, parse_mask

__version__ = "0.1.0"

__all__ = ["StofError", "STOF_FORMAT_VERSION", "TileClass", "TileLayout", "compile_mask", "MaskSpec", "parse_mask",
           "__version__"]
