"""Where benchmarks put their numbers: one JSON file each, also printed."""

from __future__ import annotations

import json
import os


def write_results(path: str, result: dict, printed: dict | None = None) -> None:
    """Writes result to path (creating its folder; "": nowhere) and prints `printed` (default: all of it)."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result if printed is None else printed, indent=2))
