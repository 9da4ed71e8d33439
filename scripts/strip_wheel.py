"""Rewrite a wheel in place without the members under the given prefixes (a folder ends in '/',
anything else names a file), for a carry to a machine without network: `scripts/gpu_wheels.sh`
drops mlflow's web UI and Ray's cluster executables, dashboard and libraries, which the GPU check
never loads (scripts/gpu/strip.txt). The wheel's RECORD drops their lines too, so pip installs
the rest as usual.

    python scripts/strip_wheel.py WHEEL PREFIX [PREFIX ...]
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile


def strip(wheel: str, prefixes: list[str]) -> tuple[int, int]:
    """Remove every member under `prefixes` (and its RECORD line); (bytes before, after)."""
    prefixes = tuple(prefixes)
    dropped = lambda name: name.startswith(prefixes)  # noqa: E731
    before = os.path.getsize(wheel)
    fd, tmp = tempfile.mkstemp(suffix=".whl", dir=os.path.dirname(os.path.abspath(wheel)))
    os.close(fd)
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            if dropped(info.filename):
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if not dropped(ln.split(",", 1)[0])).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    os.replace(tmp, wheel)
    return before, os.path.getsize(wheel)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    before, after = strip(argv[0], argv[1:])
    print(f"strip_wheel: {os.path.basename(argv[0])}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
