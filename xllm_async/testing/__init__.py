"""Tooling for tests and benchmarks, kept apart from the product: random-weight model folders
(random_model.py) and the file-controlled hold on a server's forwards (hold.py, off unless
XLLM_TEST_HOLD_DIR is set). Only service.py reaches in here, for the hold's one switch."""
