from .base import Fusion


class FuseOnnxAttention(Fusion):
    search_op_types = ()
