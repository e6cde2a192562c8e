"""The router, the gateway, the client and the CLI load no torch: they share request types and model
facts with the engine through torch-free modules (distserve.request_types, distserve.model_spec)."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = ["services.router.__main__", "services.router.server", "services.router.gateway.__main__",
              "distserve.client", "distserve.cli", "distserve.request_types", "distserve.model_spec",
              "distserve.prefix_index", "distserve.prefix_hash"]


def test_the_control_plane_imports_no_torch():
    script = ("import importlib, sys\n"
              f"for name in {TORCH_FREE!r}:\n"
              "    importlib.import_module(name)\n"
              "    if 'torch' in sys.modules:\n"
              "        sys.exit(f'{name} imported torch')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr or done.stdout
