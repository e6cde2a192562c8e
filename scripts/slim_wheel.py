"""Rewrites a wheel without the files whose path matches any of the given regular expressions, with its
RECORD redone (installers read it), in place. For wheels that must travel under a size cap
(scripts/gpu_wheels.sh): libucx ships static libraries, perftest and three copies of each library.

    python scripts/slim_wheel.py WHEEL PATTERN [PATTERN ...]
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import sys
import zipfile


def slim(path: str, patterns: list[str]) -> tuple[int, int]:
    """Drops matching files; returns the wheel's size before and after."""
    before = os.path.getsize(path)
    dropped = re.compile("|".join(patterns))
    with zipfile.ZipFile(path) as source:
        kept = [(info, source.read(info)) for info in source.infolist()
                if not dropped.search(info.filename) and not info.filename.endswith(".dist-info/RECORD")]
        record_name = next(i.filename for i in source.infolist() if i.filename.endswith(".dist-info/RECORD"))
    rows = []
    for info, data in kept:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{info.filename},sha256={digest},{len(data)}")
    rows.append(f"{record_name},,")
    temporary = path + ".tmp"
    with zipfile.ZipFile(temporary, "w", zipfile.ZIP_DEFLATED) as target:
        for info, data in kept:
            target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
        target.writestr(record_name, "\n".join(rows) + "\n")
    os.replace(temporary, path)
    return before, os.path.getsize(path)


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    before, after = slim(sys.argv[1], sys.argv[2:])
    print(f"{os.path.basename(sys.argv[1])}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
