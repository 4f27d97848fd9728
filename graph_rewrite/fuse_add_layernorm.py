from .base import Fusion


class FuseAddLayerNorm(Fusion):
    search_op_types = ()


class FuseLayerNormDecomposed(Fusion):
    search_op_types = ()
