"""Ray's wheel without what verl's actor update never loads, for a GPU machine without network.

    python scripts/strip_ray_wheel.py ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl OUT_DIR

`import verl` imports Ray (`verl/protocol.py`), but verl's actor update on one rank
(scripts/gpu_check_verl.sh) starts no Ray cluster, and Ray's wheel (~76 MiB for cp312) is over the
64 MiB a device call carries. Left out (DROP): the Java jars, the cluster's executables (GCS
server, raylet: `ray.init` needs them, `import ray` does not), the dashboard and its runtime-env
agent's vendored packages, and the libraries on top of Ray core (rllib, serve, tune, train, data,
llm, air, workflow). The rest — `_raylet.so`, `ray._private`, `ray.util`, `ray.actor`, … — is
what `import ray` and verl's `@ray.remote`-decorated classes load. RECORD is rewritten for the
files kept; the wheel keeps its name (install it from its own folder, with --no-deps).
Prints the sizes. Standard library only.
"""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

DROP = ("ray/jars/", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet",
        "ray/dashboard/client/", "ray/_private/runtime_env/agent/thirdparty_files/",
        "ray/rllib/", "ray/serve/", "ray/tune/", "ray/train/", "ray/data/", "ray/llm/", "ray/air/",
        "ray/workflow/")


def kept(name: str) -> bool:
    return not name.startswith(DROP)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def strip(src: Path, out_dir: Path) -> Path:
    """Write the stripped copy of wheel `src` into `out_dir`; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    if dst.resolve() == src.resolve():
        raise SystemExit(f"strip_ray_wheel: OUT_DIR must not hold the input wheel ({src})")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record = next(i for i in zin.infolist() if i.filename.endswith(".dist-info/RECORD"))
        lines = []
        for info in zin.infolist():
            if info.filename == record.filename or not kept(info.filename):
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            lines.append(_record_line(info.filename, data))
        lines.append(f"{record.filename},,")
        zout.writestr(record, "\n".join(lines) + "\n", compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return dst


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].endswith(".whl") or not Path(argv[0]).is_file():
        print("usage: python scripts/strip_ray_wheel.py RAY_WHEEL.whl OUT_DIR", file=sys.stderr)
        return 1
    src = Path(argv[0])
    dst = strip(src, Path(argv[1]))
    mib = 1024 * 1024
    print(f"strip_ray_wheel: {src.name}: {src.stat().st_size / mib:.1f} MiB -> {dst.stat().st_size / mib:.1f} MiB "
          f"({dst})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
