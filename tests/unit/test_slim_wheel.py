"""scripts/slim_wheel.py: a wheel rewritten without the matching files, with a RECORD that lists exactly
what is left, each with its right hash and size (what installers read)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slim_wheel.py"
spec = importlib.util.spec_from_file_location("slim_wheel", SCRIPT)
slim_wheel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slim_wheel)


def test_matching_files_leave_and_the_record_lists_the_rest(tmp_path):
    wheel = tmp_path / "libx-1.0-py3-none-any.whl"
    files = {"libx/lib/libx.so": b"so" * 100, "libx/lib/libx.so.0.0.0": b"so" * 100, "libx/lib/libx.a": b"a" * 500,
             "libx/include/x.h": b"h", "libx/__init__.py": b""}
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("libx-1.0.dist-info/RECORD", "stale\n")
    slim_wheel.slim(str(wheel), [r"\.a$", r"/include/", r"\.so\.[0-9]+\.[0-9]+\.[0-9]+$"])
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read("libx-1.0.dist-info/RECORD").decode().splitlines()
        kept = {name: z.read(name) for name in names if not name.endswith("RECORD")}
    assert set(kept) == {"libx/lib/libx.so", "libx/__init__.py"}
    digest = lambda data: base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()  # noqa: E731
    assert sorted(record) == sorted([f"{n},sha256={digest(d)},{len(d)}" for n, d in kept.items()]
                                    + ["libx-1.0.dist-info/RECORD,,"])
