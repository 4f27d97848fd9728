"""STOF-TRT graph rewriting: masked attention cores and epilogues of ONNX models -> STOF nodes (domain ``stof``).

Public API::

    from stof_trt.rewrite import rewrite_model, RewriteReport
    new_model, report = rewrite_model(model, mask="longformer:window=128,global=16", max_seq_len=512)
    print(report); report.to_dict()

See docs/rewrite.md for the patterns, and docs/nodes.md for the node contracts.
"""
from .report import RewriteReport
from .rewrite import rewrite_model

__all__ = ["rewrite_model", "RewriteReport"]
