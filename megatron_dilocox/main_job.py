"""``python -m megatron_dilocox.main_job``: the public entry of the main job.

The code lives in :mod:`megatron_dilocox.harness.main_job`; this name stays because the README and
``scripts/main_job.sh`` start it.
"""
import sys

from megatron_dilocox.harness.main_job import main

if __name__ == "__main__":
    sys.exit(main())
