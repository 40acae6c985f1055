"""The WAN testbed (``scripts/wan/wan.py``) for the ``netns`` tests: when it can run here, and its module.

wan.py is a script, not a package module, so the tests load it from its file. The ``wan`` fixture
(tests/conftest.py) gives a test module the loaded script with no testbed left over before or after it.
"""
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

WAN_PY = Path(__file__).resolve().parent.parent / "scripts" / "wan" / "wan.py"


def skip_reason() -> str | None:
    """Why the testbed cannot run on this host (None where it can): it needs root, iproute2 and ``ip netns``."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) not installed"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` unavailable"
    return None


def load_wan(name: str = "dlx_wan"):
    """scripts/wan/wan.py, imported from its file as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, WAN_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
