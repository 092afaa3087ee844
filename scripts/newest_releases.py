"""Which declared dependencies have a release newer than the tested range (run by scripts/version_ends.sh).

For each requirement in pyproject.toml with an upper bound (the base dependencies and every extra),
asks the package index for its newest release (`pip index versions`, pip's own client; one query per
package) and prints a markdown table: the declared range, the newest release, and whether that release
is inside the range (so version_ends' newest end tests it) or newer than the range (not tested: a
user installing it gets zorro's pin instead). Exit status 0 always unless --strict: then 1 when any
newest release lies above its range. Usage: python scripts/newest_releases.py [--strict] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent


def declared() -> list[Requirement]:
    """The bounded requirements of pyproject.toml (base and extras; zorro's own extras skipped)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.name != "zorro" and any(s.operator in ("<", "<=", "==") for s in r.specifier)]


def newest(name: str) -> Version | str:
    """The newest release the index lists for `name` (pre-releases excluded), or why none."""
    # The machine's pip config may cap versions (a constraints file); the index is asked without it.
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", name],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"index not reached ({type(e).__name__})"
    m = re.search(r"Available versions: (.*)", out.stdout)
    if not m:
        return "index not reached" if out.returncode else "no release listed"
    versions = []
    for v in m.group(1).split(","):
        try:
            versions.append(Version(v.strip()))
        except InvalidVersion:
            continue
    final = [v for v in versions if not v.is_prerelease]
    return max(final) if final else "no final release"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strict", action="store_true", help="exit 1 when a newest release is above its range")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args()
    rows = ["| package | declared | newest | status |", "| --- | --- | --- | --- |"]
    above = []
    for req in declared():
        got = newest(req.name)
        if isinstance(got, str):
            status = got
        elif req.specifier.contains(got, prereleases=True):
            status = "inside the range"
        else:
            status = "NEWER than the tested range"
            above.append(req.name)
        rows.append(f"| {req.name} | {req.specifier} | {got} | {status} |")
    table = "\n".join(rows)
    print(table)
    if above:
        print(f"newer than the tested range: {', '.join(above)}")
    if args.out:
        args.out.write_text(table + "\n")
    return 1 if (args.strict and above) else 0


if __name__ == "__main__":
    sys.exit(main())
