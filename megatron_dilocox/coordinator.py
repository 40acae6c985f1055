"""``python -m megatron_dilocox.coordinator``: the public entry of the standalone coordinator.

The code lives in :mod:`megatron_dilocox.net.coordinator`; this name stays because SLURM scripts,
docs/slurm.md and operators' runbooks start it.
"""
import sys

from megatron_dilocox.net.coordinator import main

if __name__ == "__main__":
    sys.exit(main())
