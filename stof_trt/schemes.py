"""Fusion schemes for the GEMM chains after attention, and the analytical cost model that ranks them (stage 1).

A transformer block has three GEMM chains after attention (docs/schemes.md):

* ``residual_ln`` -- the output projection and FFN2: ``LayerNorm(X·W + bias + residual)``;
* ``bias_gelu``   -- FFN1: ``GELU(X·W + bias)``.

Each chain can run as several *schemes*: which neighbours share a kernel.  A scheme is a named template
(:class:`SchemeTemplate`) listing the kernels it launches for a chain shape (:class:`ChainShape`) -- GEMMs with
their cuBLASLt epilogue, element-wise passes, the fused bias + residual + LayerNorm kernel -- and the nodes it
becomes in a rewritten model (stof_trt.rewrite.schemes).  Templates with a StofGemmEpilogue take the parameter
``algo``: the index of the cuBLASLt heuristic result the node runs (-1 = timed at first use, docs/ort.md).

:class:`CostModel` predicts each scheme's time from the kernels' bytes moved, FLOPs and launches on a
:class:`~stof_trt.presearch.GpuProps` (a roofline with wave quantisation for the GEMM), and :func:`rank` orders
the schemes; stof_trt.scheme_tune times the model's shortlist on the GPU (stage 2).  Schemes the model predicts
within :data:`TIE_S` of each other keep the template order, whose first entry is the rewrite's fixed rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .presearch import H100_SXM, GpuProps

__all__ = ["CHAIN_KINDS", "ChainShape", "Kernel", "SchemeTemplate", "TEMPLATES", "templates_for", "SchemeCost",
           "CostModel", "rank", "shortlist", "DEFAULT_TOKENS", "DTYPE_BYTES", "token_bucket", "default_scheme"]

#: The chain kinds and what they compute.
CHAIN_KINDS = {"residual_ln": "LayerNorm(X·W + bias + residual)", "bias_gelu": "GELU(X·W + bias)"}
#: Element size per ONNX dtype name.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float": 4}
#: Token count (GEMM M) the rewrite ranks schemes for when no measured choice is given: B = 8 at S = 512.
DEFAULT_TOKENS = 4096
#: Predicted times closer than this are a tie (the template order decides).
TIE_S = 1e-8


def token_bucket(tokens: int) -> str:
    """The cache bucket of a token count: rounded up to a power of two, at least 64 ("T4096")."""
    p = 64
    while p < int(tokens):
        p <<= 1
    return f"T{p}"


@dataclass(frozen=True)
class ChainShape:
    """One chain's problem.

    kind: "residual_ln" or "bias_gelu" (:data:`CHAIN_KINDS`).
    tokens: rows of X, the GEMM's M (batch × sequence at run time).
    n: the GEMM's N (output features; the LayerNorm width for residual_ln).
    k: the GEMM's K (input features).
    dtype: element type as ONNX names it: "float16", "bfloat16" or "float".
    activation: bias_gelu: "gelu_erf" or "gelu_tanh"; residual_ln: "none".
    sum_output: residual_ln: the pre-norm sum X·W + bias + residual is also an output (pre-LN models).
    """

    kind: str
    tokens: int
    n: int
    k: int
    dtype: str = "float16"
    activation: str = "none"
    sum_output: bool = False

    def __post_init__(self):
        if self.kind not in CHAIN_KINDS:
            raise ValueError(f"chain kind must be one of {sorted(CHAIN_KINDS)}, got {self.kind!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if min(self.tokens, self.n, self.k) < 1:
            raise ValueError(f"tokens, n, k must be positive: {self.tokens}, {self.n}, {self.k}")
        if (self.kind == "bias_gelu") != (self.activation in ("gelu_erf", "gelu_tanh")):
            raise ValueError(f"{self.kind} with activation {self.activation!r}")

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def signature(self) -> str:
        """What identifies the chain apart from its token count: "residual_ln|float16|N768|K768|sum0"."""
        tail = self.activation if self.kind == "bias_gelu" else f"sum{int(self.sum_output)}"
        return f"{self.kind}|{self.dtype}|N{self.n}|K{self.k}|{tail}"

    def bucket(self) -> str:
        return token_bucket(self.tokens)

    def with_tokens(self, tokens: int) -> "ChainShape":
        return ChainShape(self.kind, int(tokens), self.n, self.k, self.dtype, self.activation, self.sum_output)


@dataclass(frozen=True)
class Kernel:
    """One kernel launch of a scheme.

    name: what runs ("cublasLt GEMM + bias epilogue", "StofAddLayerNorm", ...).
    kind: "gemm", "elementwise" or "layernorm" (which roofline applies).
    bytes: DRAM bytes read + written.
    flops: multiply-add FLOPs (2·M·N·K for a GEMM; 0 otherwise).
    epilogue_ops: per-output-element arithmetic done in a GEMM's epilogue (bias add 1, GELU about 10).
    elements: output elements (for epilogue_ops).
    cached_bytes: bytes read again from cache (a bias vector read for every row: M·N elements).
    ort_matmul: an ONNX Runtime MatMul node rather than the library's cuBLASLt call.
    """

    name: str
    kind: str
    bytes: float
    flops: float = 0.0
    epilogue_ops: float = 0.0
    elements: float = 0.0
    cached_bytes: float = 0.0
    ort_matmul: bool = False


@dataclass(frozen=True)
class SchemeTemplate:
    """A fusion scheme: a named template with parameters.

    name: unique among the templates of its chain kind (e.g. "gemm_bias+add_ln").
    kind: the chain kind it implements.
    description: the kernels and nodes, in words.
    params: parameter names and their defaults ({"algo": -1}: the cuBLASLt heuristic index of the GEMM node).
    fixed_rule: the scheme the rewrite's fixed rules produce (ranked first on a tie).
    needs_opset: the lowest default-domain opset whose ops the scheme's nodes use.
    """

    name: str
    kind: str
    description: str
    params: dict = field(default_factory=dict)
    fixed_rule: bool = False
    needs_opset: int = 15

    @property
    def tunable(self) -> bool:
        """Whether stage 2 times cuBLASLt algorithms for it (it has a StofGemmEpilogue node)."""
        return "algo" in self.params

    def kernels(self, s: ChainShape) -> list[Kernel]:
        """The kernels this scheme launches for ``s`` (in order)."""
        e, M, N, K = s.elem, s.tokens, s.n, s.k
        mn = M * N * e
        gemm_bytes = (M * K + K * N) * e + mn
        flops = 2.0 * M * N * K
        matmul = Kernel("MatMul (cuBLAS)", "gemm", gemm_bytes, flops, ort_matmul=True)
        if s.kind == "residual_ln":
            ln_out = mn * (2 if s.sum_output else 1)           # Y (+ the pre-norm sum)
            ln = lambda extra: Kernel("StofAddLayerNorm", "layernorm", 2 * mn + ln_out + extra,  # noqa: E731
                                      cached_bytes=mn if extra else 0.0)   # the bias, read again for every row
            if self.name == "matmul+bias_add_ln":
                return [matmul, ln(N * e)]
            if self.name == "gemm+bias_add_ln":
                return [Kernel("StofGemmEpilogue (cuBLASLt, no epilogue)", "gemm", gemm_bytes, flops), ln(N * e)]
            if self.name == "gemm_bias+add_ln":
                return [Kernel("StofGemmEpilogue (cuBLASLt, bias epilogue)", "gemm", gemm_bytes + N * e, flops,
                               1.0, M * N), ln(0)]
            if self.name == "unfused":
                return [matmul,
                        Kernel("Add (bias)", "elementwise", 2 * mn + N * e),
                        Kernel("Add (residual)", "elementwise", 3 * mn),
                        Kernel("LayerNormalization", "layernorm", 2 * mn)]
        else:
            gelu_ops = 10.0
            if self.name == "gemm_bias_gelu":
                if s.activation == "gelu_tanh":  # cuBLASLt's GELU_BIAS epilogue
                    return [Kernel("StofGemmEpilogue (cuBLASLt, bias + GELU epilogue)", "gemm", gemm_bytes + N * e,
                                   flops, 1.0 + gelu_ops, M * N)]
                # exact GELU: bias in the epilogue, erf in the library's in-place pass
                return [Kernel("StofGemmEpilogue (cuBLASLt, bias epilogue)", "gemm", gemm_bytes + N * e, flops,
                               1.0, M * N),
                        Kernel("StofGemmEpilogue (GELU pass)", "elementwise", 2 * mn)]
            if self.name == "gemm_bias+gelu":
                return [Kernel("StofGemmEpilogue (cuBLASLt, bias epilogue)", "gemm", gemm_bytes + N * e, flops,
                               1.0, M * N),
                        Kernel("Gelu", "elementwise", 2 * mn)]
            if self.name == "unfused":
                return [matmul,
                        Kernel("Add (bias)", "elementwise", 2 * mn + N * e),
                        Kernel("Gelu", "elementwise", 2 * mn)]
        raise ValueError(f"template {self.name!r} does not implement {s.kind}")


#: Every template, per chain kind, in tie-break order (the fixed rule first).
TEMPLATES: dict[str, list[SchemeTemplate]] = {
    "residual_ln": [
        SchemeTemplate("gemm_bias+add_ln", "residual_ln",
                       "StofGemmEpilogue with the bias in cuBLASLt's epilogue (algorithm `algo`) -> "
                       "StofAddLayerNorm(X, residual) without bias", params={"algo": -1}, fixed_rule=True),
        SchemeTemplate("matmul+bias_add_ln", "residual_ln",
                       "MatMul (ONNX Runtime's cuBLAS) -> StofAddLayerNorm(X, residual, bias): the bias add rides "
                       "in the memory-bound LayerNorm kernel (the form the epilogue fusions leave)"),
        SchemeTemplate("gemm+bias_add_ln", "residual_ln",
                       "StofGemmEpilogue without bias (cuBLASLt, algorithm `algo`) -> StofAddLayerNorm(X, residual, "
                       "bias)", params={"algo": -1}),
        SchemeTemplate("unfused", "residual_ln",
                       "MatMul -> Add(bias) -> Add(residual) -> LayerNormalization: four kernels, the original "
                       "graph", needs_opset=17),
    ],
    "bias_gelu": [
        SchemeTemplate("gemm_bias_gelu", "bias_gelu",
                       "one StofGemmEpilogue node: cuBLASLt with the bias (and the tanh GELU) in its epilogue; the "
                       "exact GELU runs as the library's in-place pass", params={"algo": -1}, fixed_rule=True),
        SchemeTemplate("gemm_bias+gelu", "bias_gelu",
                       "StofGemmEpilogue with the bias epilogue (algorithm `algo`) -> a separate GELU (ONNX Gelu at "
                       "opset >= 20, else its element-wise form)", params={"algo": -1}),
        SchemeTemplate("unfused", "bias_gelu", "MatMul -> Add(bias) -> GELU: the original graph"),
    ],
}


def templates_for(kind: str, opset: int = 17) -> list[SchemeTemplate]:
    """The templates of a chain kind that a model of this default-domain opset can use."""
    if kind not in TEMPLATES:
        raise ValueError(f"chain kind must be one of {sorted(TEMPLATES)}, got {kind!r}")
    return [t for t in TEMPLATES[kind] if opset >= t.needs_opset]


def template(kind: str, name: str) -> SchemeTemplate:
    for t in TEMPLATES.get(kind, []):
        if t.name == name:
            return t
    raise ValueError(f"no {kind} fusion scheme named {name!r} (known: {[t.name for t in TEMPLATES.get(kind, [])]})")


def default_scheme(kind: str) -> SchemeTemplate:
    """The fixed rule's scheme for a chain kind."""
    return next(t for t in TEMPLATES[kind] if t.fixed_rule)


@dataclass(frozen=True)
class SchemeCost:
    """A scheme's predicted cost on one chain shape.

    template: the scheme.
    time_s: predicted seconds per chain (sum over kernels, launch overhead included).
    kernel_s: predicted seconds per kernel, in launch order.
    bytes: DRAM bytes moved by all its kernels.
    launches: kernel launches.
    flops: GEMM FLOPs.
    """

    template: SchemeTemplate
    time_s: float
    kernel_s: tuple
    bytes: float
    launches: int
    flops: float

    @property
    def name(self) -> str:
        return self.template.name


@dataclass(frozen=True)
class CostModel:
    """Roofline cost model of the schemes' kernels.

    gpu: the GPU's properties (sm_count, wgmma/mma TFLOP/s, DRAM bandwidth, clock); the H100 SXM's by default.
    launch_s: seconds each kernel launch adds (launch gap plus ramp-up on an otherwise busy stream).
    tile_m, tile_n: the output tile one cuBLASLt CTA computes (the wave-quantisation unit).
    k_overhead: K-equivalent of a tile's fixed prologue/epilogue cost (efficiency K / (K + k_overhead)).
    gemm_peak_fraction: fraction of the tensor-core peak a large GEMM reaches.
    memory_fraction: fraction of DRAM bandwidth an element-wise or LayerNorm kernel reaches.
    epilogue_lanes: fp32 operations per SM per clock available to a GEMM epilogue.
    cache_read_cost: time of a byte read again from cache, relative to a DRAM byte.
    ort_matmul_s: what an ONNX Runtime MatMul node costs beyond the library's cuBLASLt GEMM of the same shape (ORT
        runs its heuristic's first algorithm, the library the fastest of its first candidates, timed at first use;
        4-6 µs measured on the H200 for BERT-base's output projections at 4096 tokens).
    """

    gpu: GpuProps = H100_SXM
    launch_s: float = 3e-6
    tile_m: int = 128
    tile_n: int = 128
    k_overhead: int = 128
    gemm_peak_fraction: float = 0.8
    memory_fraction: float = 0.85
    epilogue_lanes: int = 128
    cache_read_cost: float = 0.25
    ort_matmul_s: float = 5e-6

    def gemm_rate(self, m: int, n: int, k: int) -> float:
        """Achievable FLOP/s for an M×N×K GEMM: peak × large-GEMM fraction × wave efficiency × K efficiency."""
        peak = self.gpu.wgmma_tflops if self.gpu.wgmma_tflops > 0 else self.gpu.mma_tflops
        tiles = math.ceil(m / self.tile_m) * math.ceil(n / self.tile_n)
        waves = math.ceil(tiles / self.gpu.sm_count)
        wave_eff = tiles / (waves * self.gpu.sm_count)
        k_eff = k / (k + self.k_overhead)
        return peak * self.gemm_peak_fraction * wave_eff * k_eff

    def kernel_time(self, kern: Kernel, s: ChainShape) -> float:
        mem = (kern.bytes + self.cache_read_cost * kern.cached_bytes) / \
            (self.gpu.dram_bw * (1.0 if kern.kind == "gemm" else self.memory_fraction))
        t = mem
        if kern.kind == "gemm":
            t = max(mem, kern.flops / self.gemm_rate(s.tokens, s.n, s.k))
            t += kern.epilogue_ops * kern.elements / (self.gpu.sm_count * self.gpu.clock_hz * self.epilogue_lanes)
        return t + self.launch_s + (self.ort_matmul_s if kern.ort_matmul else 0.0)

    def cost(self, tpl: SchemeTemplate, s: ChainShape) -> SchemeCost:
        ks = tpl.kernels(s)
        times = tuple(self.kernel_time(k, s) for k in ks)
        return SchemeCost(tpl, sum(times), times, sum(k.bytes for k in ks), len(ks), sum(k.flops for k in ks))


def rank(s: ChainShape, model: CostModel | None = None, *, opset: int = 17) -> list[SchemeCost]:
    """Every applicable scheme of ``s`` with its predicted cost, fastest first (ties: template order)."""
    model = model or CostModel()
    tpls = templates_for(s.kind, opset)
    costs = [model.cost(t, s) for t in tpls]
    order = {t.name: i for i, t in enumerate(tpls)}
    return sorted(costs, key=lambda c: (round(c.time_s / TIE_S), order[c.name]))


def shortlist(s: ChainShape, model: CostModel | None = None, *, k: int = 3, slack: float = 1.5,
              opset: int = 17) -> list[SchemeCost]:
    """The first ``k`` ranked schemes predicted within ``slack`` × the best, the fixed rule's scheme always
    included (stage 2 times these)."""
    ranked = rank(s, model, opset=opset)
    best = ranked[0].time_s
    out = [c for c in ranked[:k] if c.time_s <= best * slack]
    fixed = next(c for c in ranked if c.template.fixed_rule)
    if fixed not in out:
        out.append(fixed)
    return out
