from .base import Fusion


class FuseGemmGelu(Fusion):
    search_op_types = ()
