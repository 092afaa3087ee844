"""CI's own runs write nothing tracked (issue 60, defect 13): the e2e jobs that `.ci/run` calls rewrote the
committed results/verl_e2e.csv and results/openrlhf_e2e.csv, leaving a contributor's checkout modified.
Their default outputs are under an ignored folder; the committed figures change only when a person names
them (VERL_E2E_CSV / OPENRLHF_E2E_CSV)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
E2E = {"verl_e2e": "VERL_E2E_CSV", "openrlhf_e2e": "OPENRLHF_E2E_CSV"}


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.mark.parametrize("job", sorted(E2E))
def test_e2e_jobs_write_to_an_untracked_folder_by_default(job):
    text = (ROOT / ".ci" / job).read_text()
    default = re.search(rf'^csv="\$\{{{E2E[job]}:-([^}}"]+)\}}"$', text, re.M)
    assert default, f'.ci/{job} names its CSV as csv="${{{E2E[job]}:-...}}"'
    path = default.group(1)
    assert path.startswith("results/mine/"), path
    assert re.findall(r"--csv\s+(\S+)", text) == ['"$csv"'], "every --csv the job passes is that path"
    if shutil.which("git") and (ROOT / ".git").exists():
        assert _git("check-ignore", "-q", path).returncode == 0, f"{path} is not ignored by git"
        assert _git("ls-files", "--error-unmatch", path).returncode != 0, f"{path} is tracked"
