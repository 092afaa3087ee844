"""The sweep records the commit it ran from, asking git only about zorro's own checkout and
never running a hook or an fsmonitor command from the environment or a repository's config;
an install that is not a checkout runs no git at all."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import zorro_harness.bench.sweep as sweep_mod
from zorro_harness.bench.sweep import git_state

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _hook(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "ran"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    hook.chmod(0o755)
    return hook, marker


def test_an_fsmonitor_from_the_environment_is_not_run(tmp_path, monkeypatch):
    hook, marker = _hook(tmp_path)
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "core.fsmonitor")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", str(hook))
    # the probe: git itself runs it (so the test would see the fault)
    subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True)
    if not marker.exists():
        pytest.skip("this git does not run core.fsmonitor for status")
    marker.unlink()
    state = git_state()
    assert not marker.exists(), "git_state ran the core.fsmonitor command from the environment"
    assert state["git_sha"] and len(state["git_sha"]) == 40


def test_hooks_from_the_environment_are_not_run(tmp_path, monkeypatch):
    hook, marker = _hook(tmp_path)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in ("post-index-change", "reference-transaction", "fsmonitor-watchman"):
        shutil.copy(hook, hooks / name)
    monkeypatch.setenv("GIT_CONFIG_COUNT", "2")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "core.hooksPath")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", str(hooks))
    monkeypatch.setenv("GIT_CONFIG_KEY_1", "core.fsmonitor")
    monkeypatch.setenv("GIT_CONFIG_VALUE_1", str(hooks / "fsmonitor-watchman"))
    git_state()
    assert not marker.exists()


def test_an_install_that_is_not_a_checkout_runs_no_git(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sweep_mod.subprocess, "run", lambda *a, **k: calls.append(a) or None)
    assert git_state(tmp_path) == {"git_sha": None, "git_dirty": None}
    assert calls == []


def test_git_is_asked_with_hooks_and_fsmonitor_off(monkeypatch):
    calls = []
    real = subprocess.run

    def run(cmd, *a, **k):
        calls.append((cmd, k.get("env") or os.environ))
        return real(cmd, *a, **k)

    monkeypatch.setattr(sweep_mod.subprocess, "run", run)
    monkeypatch.setenv("GIT_DIR", str(Path(sys.prefix)))  # an environment pointing git elsewhere is ignored
    state = git_state()
    assert calls and state["git_sha"]
    for cmd, env in calls:
        assert cmd[0] == "git" and "core.fsmonitor=" in cmd and "core.hooksPath=/dev/null" in cmd, cmd
        assert not any(
            k.startswith("GIT_") and k not in ("GIT_CEILING_DIRECTORIES", "GIT_CONFIG_NOSYSTEM", "GIT_CONFIG_GLOBAL")
            for k in env
        )
