"""The GPU check's tooling that runs here: `scripts/strip_wheel.py` (what `make gpu-wheels` uses to
carry mlflow without its web UI) rewrites a wheel without the named folders and their RECORD
lines, and pip installs the rest."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wheel(path: Path) -> None:
    files = {"pkg/__init__.py": "X = 1\n", "pkg/ui/app.js": "x" * 5000, "pkg/ui/sub/b.css": "y",
             "pkg/uikit.py": "Y = 2\n"}
    record = "".join(f"{n},," + "\n" for n in files) + "pkg-1.0.dist-info/RECORD,,\n"
    meta = {"pkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n",
            "pkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n",
            "pkg-1.0.dist-info/RECORD": record}
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, **meta}.items():
            z.writestr(name, text)


def test_strip_wheel_drops_folders_and_their_record_lines(tmp_path):
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    _wheel(whl)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "strip_wheel.py"), str(whl), "pkg/ui/"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.startswith("strip_wheel: pkg-1.0-py3-none-any.whl:")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        record = z.read("pkg-1.0.dist-info/RECORD").decode()
    assert "pkg/uikit.py" in names and "pkg/__init__.py" in names  # a prefix, not a substring
    assert not any(n.startswith("pkg/ui/") for n in names) and "pkg/ui/" not in record
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(target), str(whl)], check=True, capture_output=True)
    assert (target / "pkg" / "uikit.py").is_file() and not (target / "pkg" / "ui").exists()
