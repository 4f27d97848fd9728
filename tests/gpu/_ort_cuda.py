"""The marks of a test module that runs on ONNX Runtime's CUDA EP with the built libstof_ort (import it after
``pytest.importorskip("onnxruntime")``)."""

import onnxruntime as ort
import pytest

from stof_trt import ort as sort

NEEDS_ORT_CUDA = [
    pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(), reason="no CUDA EP"),
    pytest.mark.skipif(not sort.library_available(), reason="libstof_ort.so not built"),
]
