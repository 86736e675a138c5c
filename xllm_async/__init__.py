"""xllm_async: an OpenAI-compatible LLM server for prefill-heavy traffic."""

import os

__version__ = "0.1.0"

# torch_npu registers itself as a torch "device backend" that torch imports on
# start-up; without Ascend's CANN that import fails and takes `import torch`
# down with it. This package is imported before torch anywhere in the project,
# so this is the one place that turns autoloading off; runtime/device.py then
# imports torch_npu explicitly when an NPU is asked for or auto-detected.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
