from .base import Fusion


class FuseOrtAttention(Fusion):
    search_op_types = ()


class FuseOrtMultiHeadAttention(Fusion):
    search_op_types = ()
