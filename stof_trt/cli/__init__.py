"""The ``stof`` command line. One module per subcommand (``add_args(parser)`` + ``run(args)``), registered in
``SUBCOMMANDS``; heavy imports (onnx, onnxruntime, torch) happen inside ``run``.

Exit status: 0 success, 2 user error (bad file, bad spec, sizes that do not fit; one line on stderr), 1 an
internal error (one line; STOF_DEBUG=1 shows the traceback)."""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

from ..errors import StofError

SUBCOMMANDS = [
    ("rewrite", "rewrite", "replace masked attention and epilogues in an ONNX model by STOF nodes"),
    ("inspect", "inspect", "list the STOF nodes of a model and draw their mask layouts"),
    ("demo", "demo", "export a small BERT, rewrite it with a Longformer mask, compare on ONNX Runtime CPU"),
    ("run", "run", "run a (rewritten) model on ONNX Runtime with the STOF plugin; print or save the outputs"),
    ("tune", "tune", "time the attention tactics of a rewritten model on this GPU; write a tactic cache"),
    ("calibrate", "calibrate", "fit the pre-search's constants on this GPU; write its pre-search profile"),
    ("bench", "bench", "latency (median/p90) and max difference: original vs STOF-rewritten model on ORT CUDA"),
    ("export-triton", "export_triton", "write a Triton Inference Server model repository (onnxruntime backend)"),
    ("serve", "serve", "serve a model with Triton Inference Server (PyTriton): HTTP + gRPC, dynamic batching"),
]


#: Longest error message printed whole (one line of a terminal's scrollback, not a quoted 100 kB spec).
MAX_ERROR_CHARS = 1000


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit 2, as every other user error (the usage is one --help away)."""

    def error(self, message):
        self.exit(2, f"stof: error: {message} (`{self.prog} --help` shows the usage)\n")

    def _print_message(self, message, file=None):
        # argparse drops a failed write (help into a full device would exit 0); main reports it
        if message:
            (file or sys.stderr).write(message)
            (file or sys.stderr).flush()


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = _Parser(
        prog="stof",
        description="STOF-TRT: fast inference for sparse (masked) Transformers. Rewrites exported ONNX models so "
                    "that masked attention and its epilogues run as STOF nodes (CUDA plugins for ONNX Runtime and "
                    "TensorRT; a portable ONNX-function fallback everywhere else).",
        epilog="Mask specs: causal | sliding:window=W | dilated:window=W,dilation=D | global:n=G | "
               "longformer:window=W,global=G | bigbird:block=B,window=1,global=1,random=P,seed=S | "
               "blocks:LAYOUT.npy,block=B | npy:MASK.npy; combine with '|' (union), '&' (intersection), "
               "parentheses (at most 64 levels). A path holding | & ( ) or , goes in quotes inside the spec: "
               "--mask \"npy:'a|b.npy'\". Windows are half-widths: sliding:window=W allows |q-k| <= W. "
               "See `python -c 'import stof_trt.masks as m; help(m)'`.")
    p.add_argument("--version", action="version", version=f"stof-trt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module, help_text in SUBCOMMANDS:
        mod = importlib.import_module(f".{module}", __name__)
        sp = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(sp)
        sp.set_defaults(_run=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except BrokenPipeError:  # `stof rewrite --help | head -1`: quiet, as below
        _silence_stdout()
        return 141
    except OSError as err:  # --help or --version into a full device (_Parser._print_message)
        return _stdout_failed(err)
    if extra:  # named against the subcommand's usage, not the top-level one
        prog = f"stof {args.command}" if getattr(args, "command", None) else "stof"
        parser.exit(2, f"stof: error: unrecognized arguments: {' '.join(extra)} (`{prog} --help` shows the usage)\n")
    from .common import quiet_onnxruntime

    quiet_onnxruntime()
    try:
        rc = int(args._run(args) or 0)
        if sys.stdout is not None:  # (closed by the caller: `stof ... >&-`)
            sys.stdout.flush()   # a closed pipe or a full device shows here, not at the interpreter's exit
        return rc
    except StofError as e:
        msg = str(e)
        if len(msg) > MAX_ERROR_CHARS:  # a message quoting a huge spec or path stays readable
            msg = f"{msg[:MAX_ERROR_CHARS]}... ({len(msg) - MAX_ERROR_CHARS} more characters)"
        print(f"stof: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stof: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`stof inspect --json | head`): stop quietly, as other command-line tools do.
        _silence_stdout()
        return 141
    except MemoryError:
        return _out_of_memory()
    except OSError as e:
        # a write to standard output (a full device, a closed descriptor): files name themselves in their errors
        if e.filename is None and e.errno in (errno.ENOSPC, errno.EBADF, errno.EIO, errno.EPIPE):
            _silence_stdout()
            print(f"stof: error: cannot write to standard output ({e.strerror or type(e).__name__})",
                  file=sys.stderr)
            return 2
        if os.environ.get("STOF_DEBUG", "") not in ("", "0"):
            raise
        return _internal(e)
    except Exception as e:  # a bug, not the user's fault: one line, the traceback on request
        if os.environ.get("STOF_DEBUG", "") not in ("", "0"):
            raise
        if isinstance(e, RuntimeError) and "can't allocate memory" in str(e):  # torch's CPU allocator
            return _out_of_memory()
        return _internal(e)


def _stdout_failed(err: OSError) -> int:
    _silence_stdout()
    print(f"stof: error: cannot write to standard output ({err.strerror or type(err).__name__})", file=sys.stderr)
    return 2


def _out_of_memory() -> int:
    print("stof: error: not enough memory for this size (a smaller --max-seq-len, batch or mask helps)",
          file=sys.stderr)
    return 2


def _internal(e: BaseException) -> int:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    print(f"stof: internal error: {type(e).__name__}: {msg} (set STOF_DEBUG=1 for the traceback; please report)",
          file=sys.stderr)
    return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
