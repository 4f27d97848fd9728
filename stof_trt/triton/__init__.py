"""Serving STOF models on NVIDIA Triton Inference Server.

* :mod:`stof_trt.triton.export`: a Triton model repository for the onnxruntime backend (``stof export-triton``).
* :mod:`stof_trt.triton.serve`: a Triton server through PyTriton with an ONNX Runtime session behind it
  (``stof serve``).

See docs/serving.md.
"""
