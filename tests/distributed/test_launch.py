"""zorro_core.distributed.launch: a rank that dies before it can report is seen at once, with its exit code,
not after the launcher's whole timeout."""

import importlib
import time

import pytest

from zorro_core.distributed.launch import launch


def test_a_rank_that_cannot_import_its_function_fails_the_launch_at_once(tmp_path, monkeypatch):
    (tmp_path / "vanishing_rank_fn.py").write_text("def fn():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = importlib.import_module("vanishing_rank_fn").fn
    # Pickled by name from the parent's sys.modules; the spawned ranks look for the file, which is gone.
    (tmp_path / "vanishing_rank_fn.py").unlink()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exit code 1\) ended without a result"):
        launch(fn, 2, init_process_group=False, timeout_s=300)
    assert time.monotonic() - start < 120  # not the 300 s timeout
