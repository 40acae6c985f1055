"""A real standalone coordinator process for the tests (``python -m megatron_dilocox.coordinator``)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from megatron_dilocox.net.rendezvous import listening

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CoordinatorProcess:
    """Started at ``address`` with ``secret``; its log goes to ``log`` (read back by ``text()``)."""

    def __init__(self, address: str, secret: str, log: str, *extra: str, wait: bool = True):
        self.address, self.log = address, log
        env = dict(os.environ, DILOCOX_SECRET=secret, PYTHONPATH=REPO)
        self._out = open(log, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_dilocox.coordinator", "--listen", address, *extra],
                                     env=env, cwd=REPO, stdout=self._out, stderr=subprocess.STDOUT)
        self.started = time.time()
        deadline = time.monotonic() + 60
        while wait and not listening(address) and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)

    def text(self) -> str:
        if not self._out.closed:
            self._out.flush()
        with open(self.log) as f:
            return f.read()

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._out.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._out.close()
