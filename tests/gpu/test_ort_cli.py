"""CPU-side pieces of the ORT tooling (no GPU needed): shape specs, random feeds, the masked feeds of `stof bench`,
`stof run --provider cpu` (STOF nodes as their ONNX functions), and CLI user errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from stof_trt.format import STOF_FORMAT_VERSION  # noqa: E402
from stof_trt import ort as sort  # noqa: E402
from stof_trt.cli import main  # noqa: E402
from stof_trt.cli.bench import feeds_for, masked_feeds  # noqa: E402
from stof_trt.errors import StofError  # noqa: E402


def test_parse_shapes():
    assert sort.parse_shapes(["a=2x3,b=4", "c=1x1x1"]) == {"a": (2, 3), "b": (4,), "c": (1, 1, 1)}
    for bad in ["a", "a=2xq", "a="]:
        with pytest.raises(StofError):
            sort.parse_shapes([bad])


class _Sess:
    def __init__(self, inputs):
        self._i = [type("I", (), {"name": n, "shape": s, "type": t}) for n, s, t in inputs]

    def get_inputs(self):
        return self._i


def test_random_feeds_kinds_and_errors():
    s = _Sess([("input_ids", ["B", "S"], "tensor(int64)"), ("attention_mask", ["B", "S"], "tensor(int64)"),
               ("token_type_ids", ["B", "S"], "tensor(int64)"), ("x", [2, 3], "tensor(float16)")])
    f = sort.random_feeds(s, {"input_ids": (2, 5), "attention_mask": (2, 5), "token_type_ids": (2, 5)})
    assert f["input_ids"].shape == (2, 5) and f["input_ids"].max() < 100
    assert (f["attention_mask"] == 1).all() and (f["token_type_ids"] == 0).all()
    assert f["x"].dtype == np.float16 and f["x"].shape == (2, 3)
    with pytest.raises(StofError, match="symbolic"):
        sort.random_feeds(s, {"input_ids": (2, 5)})
    with pytest.raises(StofError, match="does not have"):
        sort.random_feeds(s, {"input_ids": (2, 5), "attention_mask": (2, 5), "token_type_ids": (2, 5), "y": (1,)})
    with pytest.raises(StofError, match="does not fit"):
        sort.random_feeds(s, {"input_ids": (2, 5), "attention_mask": (2, 5), "token_type_ids": (2, 5), "x": (3, 3)})


def test_masked_feeds_pair_padding_and_static_mask():
    B, S = 3, 8
    feeds = {"input_ids": np.zeros((B, S), np.int64), "attention_mask": np.ones((B, S), np.int64)}
    dense = np.tril(np.ones((S, S), bool))
    f2, f3 = masked_feeds(feeds, dense, 0.5, seed=0)
    am = f2["attention_mask"]
    assert am.shape == (B, S) and am[0].all() and (am.sum(1) >= S // 2).all()
    m3 = f3["attention_mask"]
    assert m3.shape == (B, S, S)
    np.testing.assert_array_equal(m3, (dense[None] & (am[:, None, :] != 0)).astype(np.int64))
    s3 = _Sess([("input_ids", ["B", "S"], "tensor(int64)"), ("attention_mask", ["B", "S", "S"], "tensor(int64)")])
    s2 = _Sess([("input_ids", ["B", "S"], "tensor(int64)"), ("attention_mask", ["B", "S"], "tensor(int32)")])
    assert feeds_for(s3, f2, f3)["attention_mask"].ndim == 3
    got = feeds_for(s2, f2, f3)["attention_mask"]
    assert got.ndim == 2 and got.dtype == np.int32


def _tiny_stof_model(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    from stof_trt.rewrite.functions import DOMAIN, attention_overload, sparse_attention_function
    from stof_trt.format import compile_mask

    lay = compile_mask("causal", 64, 64, tile_m=32, tile_n=32)
    inits = [numpy_helper.from_array(np.ascontiguousarray(a, np.int32), n) for n, a in lay.arrays().items()]
    node = helper.make_node("StofSparseAttention", ["q", "k", "v", "row_ptr", "col_idx", "tile_bitmap_index",
                                                    "bitmaps"], ["o"], domain=DOMAIN, name="a0", scale=0.25,
                            tile_m=32, tile_n=32, seq_q=64, seq_k=64, num_layouts=1, format_version=STOF_FORMAT_VERSION,
                            mask_spec="causal")
    node.overload = attention_overload(False, False)
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, "S", 16]) for n in "qkv"]
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                          functions=[sparse_attention_function(17, False, False)])
    m.ir_version = 10
    p = tmp_path / "tiny.stof.onnx"
    import onnx

    onnx.save(m, str(p))
    return p


def test_stof_run_cpu_with_npy_inputs_and_outputs(tmp_path, capsys):
    p = _tiny_stof_model(tmp_path)
    rng = np.random.default_rng(0)
    for n in "qkv":
        np.save(tmp_path / f"{n}.npy", rng.standard_normal((1, 2, 64, 16)).astype(np.float32))
    out = tmp_path / "out"
    out.mkdir()
    rc = main(["run", str(p), "--provider", "cpu", "--input", f"q={tmp_path / 'q.npy'}", "--input",
               f"k={tmp_path / 'k.npy'}", "--input", f"v={tmp_path / 'v.npy'}", "-o", str(out), "--json"])
    assert rc == 0
    info = json.loads(capsys.readouterr().out)
    assert info["outputs"][0]["shape"] == [1, 2, 64, 16] and info["outputs"][0]["finite"]
    o = np.load(out / "o.npy")
    # query 0 attends key 0 only (causal): output row 0 = v[..., 0, :]
    np.testing.assert_allclose(o[:, :, 0], np.load(tmp_path / "v.npy")[:, :, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv,match", [
    (["run", "nope.onnx", "--provider", "cpu"], "no such file"),
    (["run", "{model}", "--provider", "cpu", "--input", "zz=x.npy"], "no such file"),
    (["run", "{model}", "--provider", "cpu", "--shapes", "q=1x2x64x16"], "symbolic|no value|shape"),
    (["tune", "{model}", "-o", "c.json"], "--shapes"),
])
def test_cli_user_errors(tmp_path, capsys, argv, match):
    import re

    p = _tiny_stof_model(tmp_path)
    argv = [a.replace("{model}", str(p)) for a in argv]
    assert main(argv) == 2
    assert re.search(match, capsys.readouterr().err)
