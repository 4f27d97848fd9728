"""Packed variable-length sequences (stof_attn_params_t.seq_offsets, qkv_format "t3hd") on the CPU: the C ABI's
host-side checks, the Python binding's parameters, the ONNX node reader.  The kernels' results are checked by
tests/gpu/test_varlen_kernels.py; these run wherever libstof_kernels.so is built (no GPU needed)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from stof_trt.format import STOF_FORMAT_VERSION, compile_mask

FAKE = 1 << 20  # 16-byte aligned, never dereferenced by the host-side checks


def _packed_params(kernels, T=300, B=3, H=2, D=64, S=128):
    """A packed problem ([T, H, D] tensors, B sequences) the library validates; pointers are not dereferenced."""
    p = kernels._Params()
    kernels.load_library().stof_attn_params_init(ctypes.byref(p))
    p.batch, p.num_heads, p.seq_q, p.seq_k, p.head_dim = B, H, S, S, D
    p.q = p.k = p.v = p.o = FAKE
    for t in "qkvo":
        setattr(p, f"{t}_stride_s", H * D)
        setattr(p, f"{t}_stride_h", D)
        setattr(p, f"{t}_stride_b", 0)
    dl = kernels.DeviceLayout(compile_mask("causal", S, S), device="cpu")
    p.layout = dl._handle
    p.seq_offsets = FAKE + 4096
    return p, dl


def _list(lib, p):
    ids = (ctypes.c_int32 * 128)()
    n = ctypes.c_int32()
    assert lib.stof_attn_list_tactics(ctypes.byref(p), ids, 128, ctypes.byref(n)) == 0, lib.stof_last_error_message()
    return [ids[i] for i in range(n.value)]


def test_packed_params_validate(kernels):
    lib = kernels.load_library()
    p, _dl = _packed_params(kernels)
    assert lib.stof_attn_validate(ctypes.byref(p)) == 0, lib.stof_last_error_message()
    packed = _list(lib, p)
    p.seq_offsets = None
    assert packed == _list(lib, p)  # the same tactics run packed sequences (TMA / persistent in their other form)


@pytest.mark.parametrize("other", ["key_lengths", "key_padding_mask"])
def test_packed_params_refuse_key_padding(kernels, other):
    lib = kernels.load_library()
    p, _dl = _packed_params(kernels)
    setattr(p, other, FAKE + 8192)
    for call in (lambda: lib.stof_attn_validate(ctypes.byref(p)),
                 lambda: lib.stof_attn_run(ctypes.byref(p), 0, None),
                 lambda: lib.stof_attn_list_tactics(ctypes.byref(p), None, 0, ctypes.byref(ctypes.c_int32()))):
        assert call() == 1  # INVALID_ARGUMENT, before anything touches the device
        msg = lib.stof_last_error_message().decode()
        assert "seq_offsets" in msg and other.split("_")[1] in msg and "\n" not in msg


def test_packed_params_misaligned_offsets(kernels):
    lib = kernels.load_library()
    p, _dl = _packed_params(kernels)
    p.seq_offsets = FAKE + 2
    assert lib.stof_attn_validate(ctypes.byref(p)) == 1
    assert b"seq_offsets" in lib.stof_last_error_message()


def test_packed_params_bound_by_the_layout(kernels):
    lib = kernels.load_library()
    p, _dl = _packed_params(kernels, S=128)
    p.seq_q = p.seq_k = 129  # the run-time bound of every sequence exceeds the compiled length
    assert lib.stof_attn_validate(ctypes.byref(p)) == 1


def test_binding_packed_params(kernels):
    """sparse_attention's packed form: [T, H, D] views (here of one [T, 3, H, D] projection), batch = B, batch
    strides 0, Sq = Sk = max_seqlen or the layout's sizes."""
    torch = pytest.importorskip("torch")
    S, T, H, D = 256, 300, 4, 64
    dl = kernels.DeviceLayout(compile_mask("causal", S, S), device="cpu")
    qkv = torch.zeros((T, 3, H, D), dtype=torch.float16)
    q, k, v = (qkv[:, i] for i in range(3))
    o = torch.zeros((T, H, D), dtype=torch.float16)
    offs = torch.tensor([0, 256, 290, 300], dtype=torch.int32)
    p = kernels._make_params(q, k, v, o, dl, None, None, None, True, seq_offsets=offs)
    assert (p.batch, p.num_heads, p.head_dim, p.seq_q, p.seq_k) == (3, H, D, S, S)
    assert (p.q_stride_b, p.q_stride_h, p.q_stride_s) == (0, D, 3 * H * D)
    assert (p.o_stride_b, p.o_stride_h, p.o_stride_s) == (0, D, H * D)
    assert p.k - p.q == H * D * 2 and p.v - p.q == 2 * H * D * 2
    assert p.seq_offsets == offs.data_ptr() and p.key_lengths is None
    lib = kernels.load_library()
    assert lib.stof_attn_validate(ctypes.byref(p)) == 0, lib.stof_last_error_message()
    p = kernels._make_params(q, k, v, o, dl, None, None, None, True, seq_offsets=offs, max_seqlen=100)
    assert (p.seq_q, p.seq_k) == (100, 100)
    # key padding with packed sequences reaches the library, which refuses it
    p = kernels._make_params(q, k, v, o, dl, None, torch.zeros(3, dtype=torch.int32), None, True, seq_offsets=offs)
    assert lib.stof_attn_validate(ctypes.byref(p)) == 1


@pytest.mark.parametrize("bad", ["rank4", "int64", "tokens", "short"])
def test_binding_packed_errors(kernels, bad):
    torch = pytest.importorskip("torch")
    dl = kernels.DeviceLayout(compile_mask("causal", 128, 128), device="cpu")
    q = torch.zeros((100, 2, 64), dtype=torch.float16)
    k = q
    offs = torch.tensor([0, 60, 100], dtype=torch.int32)
    if bad == "rank4":
        q = k = q[None]
    elif bad == "int64":
        offs = offs.long()
    elif bad == "tokens":
        k = q[:99]
    else:
        offs = offs[:1]
    with pytest.raises(ValueError):
        kernels._make_params(q, k, k, q, dl, None, None, None, True, seq_offsets=offs)


def _t3hd_model(S=256, H=12, D=64):
    from onnx import TensorProto, helper, numpy_helper

    lay = compile_mask("causal", S, S)
    inits = [numpy_helper.from_array(np.ascontiguousarray(a, np.int32), n) for n, a in lay.arrays().items()]
    node = helper.make_node("StofSparseAttention", ["qkv", "", "", "row_ptr", "col_idx", "tile_bitmap_index",
                                                    "bitmaps", "mask", "", "offsets"], ["o"], domain="stof",
                            name="t0", scale=0.125, tile_m=64, tile_n=64, seq_q=S, seq_k=S, num_layouts=1,
                            format_version=STOF_FORMAT_VERSION, mask_spec=lay.mask_spec, qkv_format="t3hd")
    ins = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT16, ["T", 3, H, D]),
           helper.make_tensor_value_info("mask", TensorProto.INT32, ["B", "S"]),
           helper.make_tensor_value_info("offsets", TensorProto.INT32, ["B1"])]
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("o", TensorProto.FLOAT16, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("stof", 1)])


def test_t3hd_attention_nodes():
    """qkv_format "t3hd" nodes (query [T,3,H,D]): heads and head dim from axes 2 and 3, the query read as key, the
    mask and seq_offsets inputs named."""
    pytest.importorskip("onnx")
    from stof_trt.nodes import attention_nodes, attention_problem_dims

    m = _t3hd_model()
    assert attention_problem_dims(m) == {"t0": ("float16", 12, 64)}
    (nd,) = attention_nodes(m)
    assert nd.tokens and not nd.packed and nd.query == nd.key == "qkv"
    assert nd.key_padding_mask == "mask" and nd.seq_offsets == "offsets" and nd.attn_bias is None
