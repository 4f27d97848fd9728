"""What the benchmark scripts share: statistics of paired rounds and the output check (stats), the anchors STOF is
judged against (anchors: the roofline floor, SDPA's backends, FlashAttention-4 natively and as FlexAttention's
FLASH backend, cuDNN's band kernel), the benchmark's masks by name (masks) and the attention benchmark's results
file, summary and table (report).

torch, triton and the cuDNN frontend are imported inside the functions that run on the GPU, so the package
imports, and its statistics run, on a machine without them.
"""
