"""`stof serve` on the CPU: a real Triton server (PyTriton) on 127.0.0.1 serving a STOF-rewritten BERT; concurrent
gRPC and HTTP requests of varied batch sizes and lengths, each answer equal to a direct ONNX Runtime run; bad
requests (wrong dtype, wrong rank, oversize batch, longer than the model's positions) each answered with a clear
error while the server keeps serving; SIGTERM stops it cleanly. Needs a serving interpreter (docs/serving.md;
.ci/run makes one)."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
SEQ = 32


def run_cli(*args, timeout=300):
    p = subprocess.run([sys.executable, "-m", "stof_trt.cli", *args], capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def port_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def serve_python():
    from stof_trt.errors import StofError
    from stof_trt.triton.serve import find_python

    try:
        py, _ = find_python()
    except StofError as e:
        pytest.skip(f"no serving interpreter: {e}")
    return py


@pytest.fixture(scope="module")
def stof_bert(tmp_path_factory):
    pytest.importorskip("transformers")
    from stof_trt.export import export_bert

    d = tmp_path_factory.mktemp("serve")
    src = str(d / "bert.onnx")
    export_bert(src, layers=1, hidden=32, heads=2, intermediate=64, seq_len=SEQ, max_positions=SEQ,
                vocab_size=100)
    out = str(d / "bert.stof.onnx")
    rc, _, err = run_cli("rewrite", src, "-o", out, "--mask", "longformer:window=4,global=2", "--max-seq-len",
                         str(SEQ))
    assert rc == 0, err
    return out


def relu_model(path):
    """A one-node model with a batch axis: enough for the checks before a server starts."""
    from onnx import TensorProto, helper, save

    g = helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["b", 4])])
    save(helper.make_model(g), str(path))


def test_serve_errors_are_one_line_exit_2(tmp_path):
    rc, _, err = run_cli("serve", str(tmp_path / "missing.onnx"))
    assert rc == 2 and err.startswith("stof: error: no such file") and len(err.strip().splitlines()) == 1
    (tmp_path / "m.onnx").write_bytes(b"\x01\x02garbage")
    rc, _, err = run_cli("serve", str(tmp_path / "m.onnx"))
    assert rc == 2 and "not a readable ONNX model" in err and len(err.strip().splitlines()) == 1


def test_a_port_in_use_is_refused_before_the_server_starts(tmp_path):
    """Triton would start, fail to bind, and leave the wait polling the other program: refused up front instead."""
    relu_model(tmp_path / "relu.onnx")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        free = free_ports(1)[0]
        for flag, args in (("--port", ["--port", str(taken)]),
                           ("--grpc-port", ["--port", str(free), "--grpc-port", str(taken)]),
                           ("--metrics-port", ["--port", str(free), "--metrics-port", str(taken)])):
            rc, out, err = run_cli("serve", str(tmp_path / "relu.onnx"), *args)
            assert rc == 2 and len(err.strip().splitlines()) == 1, err
            assert f"{flag} {taken}: the port is in use" in err and "ready" not in out, err


def test_the_reason_tritonserver_gave_is_found_in_its_log(tmp_path):
    from stof_trt.triton.serve import last_server_error

    log = tmp_path / "tritonserver.log"
    log.write_text('I1130 01:34:34.177 7214 http_server.cc:4713] "Started HTTPService at 127.0.0.1:18100"\n'
                   'E1130 01:34:34.258 7214 main.cc:257] "failed to start HTTP service: Unavailable - Socket '
                   "'127.0.0.1:18100' already in use \"\n"
                   'W1130 01:34:34.300 7214 metrics.cc:798] "DCGM unable to start"\n')
    want = "failed to start HTTP service: Unavailable - Socket '127.0.0.1:18100' already in use"
    assert last_server_error(str(log)) == want
    log.write_text('W1130 01:34:34.300 7214 metrics.cc:798] "DCGM unable to start"\n')
    assert last_server_error(str(log)) is None
    assert last_server_error(str(tmp_path / "missing.log")) is None


def test_token_slot_models_are_refused_in_one_line(tmp_path):
    """A model packed into token slots (--token-capacity-input) needs its capacity sized per batch: neither server
    does that, so both refuse it before any work."""
    from onnx import TensorProto, helper, save

    g = helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", 4]),
                           helper.make_tensor_value_info("stof_token_capacity", TensorProto.INT32, ["c"])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["b", 4])])
    save(helper.make_model(g), str(tmp_path / "slots.onnx"))
    for cmd in (("serve", str(tmp_path / "slots.onnx")),
                ("export-triton", str(tmp_path / "slots.onnx"), "--repo", str(tmp_path / "repo"))):
        rc, _, err = run_cli(*cmd)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "stof_token_capacity" in err, err
    assert not (tmp_path / "repo").exists()


def test_serve_without_a_serving_python_says_why(tmp_path):
    relu_model(tmp_path / "relu.onnx")
    rc, _, err = run_cli("serve", str(tmp_path / "relu.onnx"), "--python", str(tmp_path / "no-python"))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "no Python to serve with" in err and "docs/serving.md" in err


def test_serve_python_with_pytriton_outside_site_packages_says_so(tmp_path):
    """PyTriton installed through pip --target / PYTHONPATH cannot start tritonserver (its libraries are looked up
    next to a site-packages folder): the probe names that instead of letting the server die at start."""
    import json
    import sys

    from stof_trt.triton.serve import probe_python

    info = {"python": "3.12.3", "shared_libpython": True, "libdir": "/usr/lib", "pytriton": "0.7.0",
            "numpy": "1.26.4", "onnxruntime": "1.31.1", "providers": ["CPUExecutionProvider"]}
    fake = tmp_path / "python"
    for libs, want in ((False, "not installed in a site-packages folder"), (True, None)):
        fake.write_text(f"#!{sys.executable}\nprint({json.dumps(json.dumps(dict(info, pytriton_libs=libs)))})\n")
        fake.chmod(0o755)
        got = probe_python(str(fake))
        if want:
            assert isinstance(got, str) and want in got and "virtual environment" in got, got
        else:
            assert isinstance(got, dict) and got["pytriton_libs"] is True, got


def start_server(model, serve_python, log_path, ports, max_batch):
    """`stof serve` on the CPU in the background: (process, its stdout lines, its log file, None once ready) or
    (None, None, None, why it did not become ready)."""
    http, grpc, metrics = ports
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "stof_trt.cli", "serve", model, "--port", str(http),
                             "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--max-batch",
                             str(max_batch), "--max-queue-delay-us", "2000", "--provider", "cpu", "--name", "bert",
                             "--python", serve_python, "--ready-timeout", "180"],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    ready = threading.Event()
    lines = []

    def drain():  # read everything: a full pipe would block the server's logging
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("stof serve: bert ready"):
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + 210
    while not ready.wait(0.5) and proc.poll() is None and time.monotonic() < deadline:
        pass
    if ready.is_set():
        return proc, lines, log, None
    if proc.poll() is None:  # stof serve stops its worker on SIGTERM
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
    log.close()
    return None, None, None, (f"rc {proc.returncode}: {log_path.read_text()[-2000:]}\nits stdout: "
                              f"{''.join(lines)[-2000:]}")


def test_served_answers_equal_direct_ort_and_bad_requests_fail_cleanly(stof_bert, serve_python, tmp_path):
    import onnxruntime as ort

    max_batch = 4
    rng = np.random.default_rng(0)
    reqs = {"max_batch": np.array(max_batch), "max_len": np.array(SEQ)}
    shapes = [(1, 8), (2, 16), (3, 32), (4, 24), (1, 32), (2, 8), (4, 32), (3, 16), (2, 24), (1, 16), (4, 8),
              (2, 32)]
    for k, (b, s) in enumerate(shapes):
        reqs[f"ids_{k}"] = rng.integers(0, 100, (b, s)).astype(np.int64)
        lengths = rng.integers(1, s + 1, b)
        lengths[0] = s
        reqs[f"mask_{k}"] = (np.arange(s)[None] < lengths[:, None]).astype(np.int64)
    np.savez(tmp_path / "req.npz", **reqs)

    # PyTriton's start (tritonserver, its Python-backend stub processes) runs beside everything else on a shared
    # machine: a start that does not come up is retried once on fresh ports, and both reasons are kept
    failures = []
    for attempt in range(2):
        http, grpc, metrics = free_ports(3)
        proc, lines, log, why = start_server(stof_bert, serve_python, tmp_path / f"serve{attempt}.log",
                                             [http, grpc, metrics], max_batch)
        if why is None:
            break
        failures.append(why)
    assert len(failures) < 2, "server not ready twice:\n" + "\n".join(failures)
    if failures:
        warnings.warn(f"stof serve came up at the second start; the first: {failures[0][:500]}")
    try:
        ready_line = next(x for x in lines if x.startswith("stof serve: bert ready"))
        assert f"127.0.0.1:{http}" in ready_line and f"127.0.0.1:{grpc}" in ready_line

        c = subprocess.run([serve_python, str(HERE / "triton_serve_client.py"), "bert", f"127.0.0.1:{http}",
                            f"127.0.0.1:{grpc}", str(tmp_path / "req.npz"), str(tmp_path / "out.npz"),
                            str(tmp_path / "err.json")], capture_output=True, text=True, timeout=240)
        assert c.returncode == 0, c.stderr[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    log.close()
    assert rc == 0, open(log.name).read()[-2000:]
    assert all(port_free(p) for p in (http, grpc, metrics)), "the server left a port bound after SIGTERM"

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(stof_bert, so, providers=["CPUExecutionProvider"])
    outs = np.load(tmp_path / "out.npz")
    for k, (b, s) in enumerate(shapes):
        ref = sess.run(None, {"input_ids": reqs[f"ids_{k}"], "attention_mask": reqs[f"mask_{k}"]})[0]
        got = outs[f"out_{k}"]
        assert got.shape == ref.shape == (b, s, 32)
        assert np.abs(ref).max() > 0.1 and np.abs(got - ref).max() < 1e-5, (k, np.abs(got - ref).max())
    ref0 = sess.run(None, {"input_ids": reqs["ids_0"], "attention_mask": reqs["mask_0"]})[0]
    assert np.abs(outs["after"] - ref0).max() < 1e-5  # still serving after the bad requests

    errors = json.loads((tmp_path / "err.json").read_text())
    assert sorted(errors) == sorted(f"{c}/{p}" for c in ("wrong_dtype", "wrong_rank", "too_long", "oversize_batch")
                                    for p in ("grpc", "http"))
    for key, msg in errors.items():
        assert msg, f"{key}: the server accepted a bad request"
        case = key.split("/")[0]
        expected = {"wrong_dtype": "data-type is 'FP32', but model 'bert' expects 'INT64'",
                    "wrong_rank": "unexpected shape for input",
                    "too_long": "onnxruntime rejected the request",
                    "oversize_batch": f"batch-size must be <= {max_batch}"}[case]
        assert expected in msg, (key, msg)


def test_serve_cuda_without_cuda_ep_says_so(serve_python, tmp_path):
    """The serving interpreter's onnxruntime decides: a CPU build refuses --provider cuda in one line."""
    import subprocess as sp

    probe = sp.run([serve_python, "-c", "import onnxruntime as o; print('CUDAExecutionProvider' in "
                    "o.get_available_providers())"], capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "False":
        pytest.skip("the serving interpreter has the CUDA EP")
    relu_model(tmp_path / "relu.onnx")
    rc, _, err = run_cli("serve", str(tmp_path / "relu.onnx"), "--provider", "cuda", "--python", serve_python)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "has no CUDA EP" in err, err


@pytest.mark.parametrize("python", ["/bin/true", "/nonexistent/python"])
def test_a_named_serving_interpreter_is_used_or_refused(monkeypatch, python):
    from stof_trt.errors import StofError
    from stof_trt.triton.serve import find_python

    monkeypatch.setenv("STOF_SERVE_PYTHON", python)
    with pytest.raises(StofError, match=python):
        find_python()
