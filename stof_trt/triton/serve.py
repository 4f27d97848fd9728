"""`stof serve`: a Triton Inference Server (through PyTriton) with an ONNX Runtime session behind it.

The server runs in a child process, ``_serve_worker.py``, under a *serving interpreter*: a Python where
``pytriton``, ``onnxruntime`` and ``numpy`` import. PyTriton's Python-backend stub needs a Python built with a
shared libpython (the worker gets that interpreter's LIBDIR first on LD_LIBRARY_PATH), and pytriton pins
numpy < 2, so that interpreter is often a dedicated virtual environment rather than the one running ``stof``.
It is ``--python`` or ``$STOF_SERVE_PYTHON`` when given (that one, or an error), else the first that works of
``~/.cache/stof-trt/serve-venv/bin/python`` (see docs/serving.md) and the current interpreter.

On a GPU (libstof_ort.so found and the serving interpreter's onnxruntime has the CUDA EP) the session runs the
CUDA EP with the STOF library and the tactic cache; otherwise the CPU EP runs the STOF nodes' model-local ONNX
functions.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..errors import StofError

WORKER = Path(__file__).resolve().parent / "_serve_worker.py"
DEFAULT_VENV_PYTHON = Path.home() / ".cache" / "stof-trt" / "serve-venv" / "bin" / "python"
READY_PREFIX = "stof-serve-ready "

_PROBE = (
    "import json, sys, sysconfig\n"
    "import numpy, onnxruntime, pytriton\n"
    "from pytriton.utils.distribution import get_libs_path\n"
    "from importlib.metadata import version\n"
    "cfg = sysconfig.get_config_var\n"
    "print(json.dumps({'python': sys.version.split()[0], 'shared_libpython': bool(cfg('Py_ENABLE_SHARED')),\n"
    "                  'libdir': cfg('LIBDIR'), 'pytriton': version('nvidia-pytriton'),\n"
    "                  'numpy': numpy.__version__, 'onnxruntime': onnxruntime.__version__,\n"
    "                  'providers': onnxruntime.get_available_providers(),\n"
    "                  'pytriton_libs': get_libs_path().is_dir()}))\n")


def _stof_ort_library() -> Path | None:
    """libstof_ort.so as the rest of the package finds it (one place to change if that helper moves)."""
    from ..ort import library_path

    return library_path()


def probe_python(python: str, timeout: float = 120) -> dict | str:
    """What the interpreter offers for serving (a dict), or why it cannot serve (a string)."""
    try:
        p = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: cannot run ({type(e).__name__})"
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["exit status " + str(p.returncode)])[-1]
        return f"{python}: {last}"
    try:
        info = json.loads(p.stdout.strip().splitlines()[-1])
        info["python"], info["shared_libpython"]
    except (IndexError, ValueError, TypeError, KeyError):
        return f"{python}: not a Python interpreter that runs the probe (no report on its output)"
    if not info["shared_libpython"]:
        return f"{python}: Python {info['python']} without a shared libpython (PyTriton's stub needs one)"
    if not info.get("pytriton_libs", True):
        # PyTriton finds tritonserver's libraries next to a site-packages folder of the interpreter, and its stub
        # sees that environment's packages only: an install through pip --target or PYTHONPATH does not serve
        return (f"{python}: nvidia-pytriton is not installed in a site-packages folder of this interpreter "
                "(pip --target / PYTHONPATH installs cannot start its server): install it into a virtual environment")
    return info


def find_python(explicit: str | None = None) -> tuple[str, dict]:
    """The serving interpreter and its probe; a one-line StofError naming what each candidate lacks."""
    env = os.environ.get("STOF_SERVE_PYTHON")
    if explicit or env:  # named by the user: that one or an error, never silently another
        cands = [explicit or env]
    else:
        cands = [c for c in (str(DEFAULT_VENV_PYTHON), sys.executable) if c == sys.executable or os.path.exists(c)]
    why = []
    for c in dict.fromkeys(cands):
        r = probe_python(c)
        if isinstance(r, dict):
            return c, r
        why.append(r)
    raise StofError("no Python to serve with (needs nvidia-pytriton, onnxruntime, numpy<2 and a shared libpython; "
                    "see docs/serving.md, or pass --python / set STOF_SERVE_PYTHON): " + "; ".join(why))


def worker_env(info: dict) -> dict:
    """The worker's environment: the serving interpreter's own libpython first on the loader path. PyTriton's
    stub embeds Python by loading libpython3.X.so by name; without this it can pick another build of the same
    version (the system's) whose runtime does not match the interpreter's standard library."""
    env = dict(os.environ)
    if info.get("libdir"):
        rest = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([info["libdir"]] + rest)
    return env


def port_taken(host: str, port: int) -> bool:
    """Whether something already listens on (host, port). Triton would start, fail to bind and leave PyTriton
    polling the other program for minutes; a socket in TIME_WAIT does not count (Triton reuses the address)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror:
            raise StofError(f"--host {host}: not an address of this machine") from None
        except OSError:
            return True
    return False


def worker_command(python: str, model: str, *, name: str, host: str, http_port: int, grpc_port: int,
                   metrics_port: int, max_batch: int, max_queue_delay_us: int, instances: int, provider: str,
                   device: int = 0, library: str | None = None, tactic_cache: str | None = None,
                   server_log: str | None = None) -> list[str]:
    cmd = [python, str(WORKER), "--model", str(model), "--name", name, "--host", host,
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
           "--max-batch", str(max_batch), "--max-queue-delay-us", str(max_queue_delay_us),
           "--instances", str(instances), "--provider", provider, "--device", str(device)]
    if library:
        cmd += ["--library", str(library)]
    if tactic_cache:
        cmd += ["--tactic-cache", str(tactic_cache)]
    if server_log:
        cmd += ["--server-log", str(server_log)]
    return cmd


def last_server_error(log: str) -> str | None:
    """The last error line tritonserver wrote to its log, without its timestamp prefix (its warnings are routine:
    no GPU, no NVML, no DCGM)."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line[:1] == "E" and line[1:5].isdigit():
            msg = line.split("] ", 1)[-1].strip().strip('"').strip()
            return msg[:300] or None
    return None


def serve(model: str, *, port: int = 8000, grpc_port: int | None = None, metrics_port: int | None = None,
          host: str = "127.0.0.1", name: str | None = None, max_batch: int = 8, max_queue_delay_us: int = 100,
          instances: int = 1, provider: str = "auto", device: int = 0, tactic_cache: str | None = None,
          python: str | None = None, ready_timeout: float = 300, on_ready=None, out=sys.stdout) -> int:
    """Start the server and block until it stops (SIGINT/SIGTERM stop it cleanly); returns the exit status.
    ``on_ready(info)`` is called once the endpoints accept requests."""
    import onnx

    from .export import default_name, stof_node_count

    if not os.path.isfile(model):
        raise StofError(f"no such file: {model}")
    try:
        proto = onnx.load(model, load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf DecodeError and friends
        raise StofError(f"{model} is not a readable ONNX model ({(str(e).splitlines() or [''])[0]})") from None
    from .export import refuse_token_slots

    refuse_token_slots(proto, model)
    for p in [port] + [q for q in (grpc_port, metrics_port) if q is not None]:
        if not 0 < p < 65536:
            raise StofError(f"bad port {p}")
    if max_batch < 0 or instances < 1 or max_queue_delay_us < 0:
        raise StofError("--max-batch and --max-queue-delay-us must be >= 0, --instances >= 1")
    if tactic_cache is not None and not os.path.isfile(tactic_cache):
        raise StofError(f"tactic cache not found: {tactic_cache}")
    grpc_port = grpc_port if grpc_port is not None else port + 1
    metrics_port = metrics_port if metrics_port is not None else port + 2
    if len({port, grpc_port, metrics_port}) < 3:
        raise StofError(f"HTTP, gRPC and metrics ports must differ ({port}, {grpc_port}, {metrics_port})")
    name = name or default_name(model)
    for what, p in (("--port", port), ("--grpc-port", grpc_port), ("--metrics-port", metrics_port)):
        if port_taken(host, p):
            raise StofError(f"{what} {p}: the port is in use on {host} (another server?); pick another")

    py, info = find_python(python)
    has_stof = stof_node_count(proto) > 0
    lib = _stof_ort_library() if has_stof else None
    cuda_ok = "CUDAExecutionProvider" in info["providers"]
    if provider == "auto":
        provider = "cuda" if cuda_ok and (lib is not None or not has_stof) else "cpu"
    if provider == "cuda":
        if not cuda_ok:
            raise StofError(f"--provider cuda: the serving Python's onnxruntime {info['onnxruntime']} has no CUDA EP "
                            f"({py}); install onnxruntime-gpu there")
        if has_stof and lib is None:
            raise StofError("--provider cuda: libstof_ort.so not found (build it or set STOF_ORT_LIB)")
    elif tactic_cache:
        raise StofError("--tactic-cache applies to the GPU kernels; this server runs the CPU EP")

    logdir = tempfile.TemporaryDirectory(prefix="stof-serve-")  # tritonserver's own log, read when it fails
    server_log = os.path.join(logdir.name, "tritonserver.log")
    cmd = worker_command(py, os.path.abspath(model), name=name, host=host, http_port=port, grpc_port=grpc_port,
                         metrics_port=metrics_port, max_batch=max_batch, max_queue_delay_us=max_queue_delay_us,
                         instances=instances, provider=provider, device=device,
                         library=str(lib) if provider == "cuda" and lib else None,
                         tactic_cache=os.path.abspath(tactic_cache) if tactic_cache else None,
                         server_log=server_log)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True, env=worker_env(info))
    stopping = threading.Event()

    def forward(signum, _frame):
        stopping.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    ready = threading.Event()
    said = []  # the worker's last non-blank line: named when it never becomes ready
    try:
        def pump():  # the worker's stdout: the ready line, then whatever the server prints
            for line in proc.stdout:
                if line.startswith(READY_PREFIX) and not ready.is_set():
                    ready_info = json.loads(line[len(READY_PREFIX):])
                    ready_info.update(python=py, pytriton=info["pytriton"])
                    ready.set()
                    print(f"stof serve: {ready_info['model']} ready on http {ready_info['http']}, grpc "
                          f"{ready_info['grpc']} ({provider}, max batch {max_batch}); Ctrl-C stops", file=out,
                          flush=True)
                    if on_ready:
                        on_ready(ready_info)
                else:
                    if line.strip():
                        said[:] = [line.strip()]
                    out.write(line)
                    out.flush()

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        deadline = time.monotonic() + ready_timeout
        while not ready.is_set() and proc.poll() is None and time.monotonic() < deadline and not stopping.is_set():
            time.sleep(0.1)
        if not ready.is_set() and proc.poll() is None and not stopping.is_set():
            proc.send_signal(signal.SIGTERM)
            _wait(proc)
            why = last_server_error(server_log)
            last = (f"; tritonserver said: {why}" if why else f"; its last line: {said[0][:200]}" if said
                    else "; it printed nothing")
            raise StofError(f"the server did not become ready within {ready_timeout:.0f} s (serving Python {py}, "
                            f"--ready-timeout sets the wait){last}")
        rc = proc.wait() if proc.poll() is None else proc.returncode
        while proc.poll() is None:
            time.sleep(0.1)
        t.join(timeout=5)
        if not ready.is_set() and not stopping.is_set():
            why = last_server_error(server_log)
            if why:
                raise StofError(f"the server exited with status {rc} before it was ready; tritonserver said: {why}")
            raise StofError(f"the server exited with status {rc} before it was ready (serving Python {py}, "
                            f"pytriton {info['pytriton']}); its log is above. PyTriton's stub fails under some "
                            "interpreters: point --python at another one, e.g. a virtual environment made from the "
                            "system Python (docs/serving.md)")
        return 0 if stopping.is_set() and rc in (0, -signal.SIGTERM) else rc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            _wait(proc)
        for s, h in old.items():
            signal.signal(s, h)
        logdir.cleanup()


def _wait(proc, timeout: float = 30) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
