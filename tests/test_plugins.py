"""zorro's after-import hook (zorro_plugins.hooks, installed in every process that imports verl) beside
another library's finder of the same shape: one that also watches a module and also asks every other
finder on sys.meta_path. Without a guard the two ask each other until RecursionError."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SECOND_FINDER = """
import importlib.abc, sys

class AskEveryOther(importlib.abc.MetaPathFinder):
    # another library's post-import hook of the common shape, with no guard of its own
    def __init__(self, watched):
        self.watched, self.seen = watched, 0

    def find_spec(self, fullname, path, target=None):
        if fullname != self.watched:
            return None
        self.seen += 1
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None
"""


def _run(tmp_path: Path, order: str) -> subprocess.CompletedProcess:
    (tmp_path / "zz_watched.py").write_text("VALUE = 7\n")
    (tmp_path / "second_finder.py").write_text(SECOND_FINDER)
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from second_finder import AskEveryOther
        from zorro_plugins.hooks import after_import

        ran = []
        other = AskEveryOther("zz_watched")
        if {order!r} == "other-first":
            sys.meta_path.insert(0, other)
            after_import("zz_watched", lambda: ran.append(1))
        else:
            after_import("zz_watched", lambda: ran.append(1))
            sys.meta_path.insert(0, other)
        import zz_watched
        assert zz_watched.VALUE == 7 and ran == [1] and other.seen >= 1, (ran, other.seen)
        print("ok")
        """
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_after_import_beside_a_finder_that_asks_every_other(tmp_path):
    for order in ("zorro-first", "other-first"):
        res = _run(tmp_path, order)
        assert res.returncode == 0 and res.stdout.strip() == "ok", (order, res.stderr[-2000:])


HOOKING_FINDER = """
import importlib.abc, sys

class Wrapped(importlib.abc.Loader):
    def __init__(self, inner, hooks):
        self.inner, self.hooks = inner, hooks

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.hooks.append(module.__name__)

class HookEveryOther(importlib.abc.MetaPathFinder):
    # another library's post-import hook that asks every finder (no guard) and wraps the loader it gets
    def __init__(self, watched):
        self.watched, self.hooks = watched, []

    def find_spec(self, fullname, path, target=None):
        if fullname != self.watched:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = Wrapped(spec.loader, self.hooks)
                return spec
        return None
"""


def test_each_hook_runs_once_beside_a_finder_that_asks_every_other(tmp_path):
    """Issue 60, defect 11: zorro's finder asked the finders before it again, so another library's hook that
    asks every finder ran twice; now each runs once, whichever finder is first."""
    (tmp_path / "zz_hooked.py").write_text("VALUE = 8\n")
    (tmp_path / "hooking_finder.py").write_text(HOOKING_FINDER)
    for other_first in (True, False):
        code = textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(tmp_path)!r})
            from hooking_finder import HookEveryOther
            from zorro_plugins.hooks import after_import

            ran = []
            other = HookEveryOther("zz_hooked")
            if {other_first!r}:
                after_import("zz_hooked", lambda: ran.append(1))
                sys.meta_path.insert(0, other)
            else:
                sys.meta_path.insert(0, other)
                after_import("zz_hooked", lambda: ran.append(1))
            assert (sys.meta_path[0] is other) == {other_first!r}
            import zz_hooked
            assert zz_hooked.VALUE == 8 and ran == [1] and other.hooks == ["zz_hooked"], (ran, other.hooks)
            print("ok")
            """
        )
        env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0 and res.stdout.strip() == "ok", (other_first, res.stderr[-2000:])
