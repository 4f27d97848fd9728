"""What the benchmark scripts share: statistics of paired rounds (stats), the anchors STOF is judged against
(anchors: the roofline floor, SDPA's backends, cuDNN's band kernel) and the benchmark's masks by name (masks).

torch, triton and the cuDNN frontend are imported inside the functions that run on the GPU, so the package
imports, and its statistics run, on a machine without them.
"""
