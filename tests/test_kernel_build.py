"""Which build of our CPU kernels a process loads (model/cpu_kernels.py library_path): one named by
every source it compiles and every header those share (csrc/*.cpp, csrc/*.h), so that a change to
any of them, a shared header included, builds a new library instead of loading a stale one."""

import os
import shutil

from xllm_async.model import cpu_kernels


def test_a_change_to_any_source_or_header_names_a_new_library(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc, ignore=shutil.ignore_patterns("build"))
    monkeypatch.setattr(cpu_kernels, "CSRC", str(csrc))
    unchanged = cpu_kernels.library_path()
    assert cpu_kernels.library_path() == unchanged  # (the same bytes: the same library)
    names = sorted(name for name in os.listdir(csrc) if name.endswith((".cpp", ".h")))
    assert any(name.endswith(".h") for name in names) and any(name.endswith(".cpp") for name in names)
    for name in names:
        text = (csrc / name).read_text()
        (csrc / name).write_text(text + "\n")
        assert cpu_kernels.library_path() != unchanged, f"a change to {name} would load the old library"
        (csrc / name).write_text(text)
    assert cpu_kernels.library_path() == unchanged
