"""flash-attn's own Python package at the releases zorro supports, from PyPI's sdists (tests only).

Only `flash_attn/__init__.py` and `flash_attn/flash_attn_interface.py` are taken from each sdist
(pinned by sha256): the interface's custom-op registration, argument handling and return tuples run
for real; the compiled `flash_attn_2_cuda` is the CPU emulation (flash_attn_ext). Nothing is built.
The sdists are cached in .cache/flash-attn-sdists (ignored by git); `python -m
tests.kernel_emulation.sdists` downloads the missing ones (CI: .ci/flash_attn_sdists).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "flash-attn-sdists"
FILES = "https://files.pythonhosted.org/packages"
SDISTS = {
    "2.6.3": (
        f"{FILES}/cd/1e/21321670cd3c2f225026d9fd89272cae661529238850e79f48ccf2f9e4e3/flash_attn-2.6.3.tar.gz",
        "5bfae9500ad8e7d2937ebccb4906f3bc464d1bf66eedd0e4adabd520811c7b52",
    ),
    "2.7.4.post1": (
        f"{FILES}/11/34/9bf60e736ed7bbe15055ac2dab48ec67d9dbd088d2b4ae318fd77190ab4e/flash_attn-2.7.4.post1.tar.gz",
        "f03485c9a49a4d68d0733acdcad80ab0e72afa025a777fdc2966ceccf9d51765",
    ),
    "2.8.3.post2": (
        f"{FILES}/6c/b1/b77625e3d11260d2bd6a4fc249a4be9a3da97ff848e2222e810c4f0e0211/flash_attn-2.8.3.post2.tar.gz",
        "d0f9f0b08a986cdeadbffcf5ec8b3a8f514366c68ad1853d3ab061bc83cc340b",
    ),
}
VERSIONS = tuple(SDISTS)
PACKAGE_FILES = ("flash_attn/__init__.py", "flash_attn/flash_attn_interface.py")
REQUIRED_ENV = "ZORRO_FLASH_ATTN_SDISTS_REQUIRED"
"""Set (CI does) to fail, not skip, when an sdist is missing."""


def package_dir(version: str) -> Path:
    """The folder holding release `version`'s `flash_attn` package (its two Python files)."""
    return CACHE / version


def missing() -> list[str]:
    return [v for v in VERSIONS if not all((package_dir(v) / f).is_file() for f in PACKAGE_FILES)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(version: str) -> None:
    """Download release `version`'s sdist (checked against its pinned sha256) and extract its two files."""
    url, sha = SDISTS[version]
    CACHE.mkdir(parents=True, exist_ok=True)
    tarball = CACHE / url.rsplit("/", 1)[1]
    if not tarball.is_file() or _sha256(tarball) != sha:
        tmp = tarball.with_suffix(".part")
        urllib.request.urlretrieve(url, tmp)  # noqa: S310 - a pinned https URL
        if _sha256(tmp) != sha:
            tmp.unlink()
            raise RuntimeError(f"flash-attn {version}: the sdist's sha256 is not the pinned {sha}")
        tmp.replace(tarball)
    prefix = f"flash_attn-{version}/"
    with tarfile.open(tarball) as tar:
        for name in PACKAGE_FILES:
            member = tar.getmember(prefix + name)
            data = tar.extractfile(member)
            assert data is not None
            dest = package_dir(version) / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data.read())
    tarball.unlink()  # only the two files are kept


if __name__ == "__main__":
    for v in missing():
        print(f"flash-attn {v}: downloading its sdist", file=sys.stderr)
        fetch(v)
    print(f"flash-attn {', '.join(VERSIONS)}: in {os.path.relpath(CACHE)}", file=sys.stderr)
