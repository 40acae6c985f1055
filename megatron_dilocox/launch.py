"""``python -m megatron_dilocox.launch``: the public entry of the single-host launcher (C torchrun clusters).

The code lives in :mod:`megatron_dilocox.harness.launch`; this name stays because the Docker image's
default command and docs/megatron.md start it.
"""
import sys

from megatron_dilocox.harness.launch import main

if __name__ == "__main__":
    sys.exit(main())
