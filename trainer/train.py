"""``python -m ckptflow.trainer.train``: the documented command of the reference job.

The job itself is an example user of the library and lives in ``reference/job.py``;
this module only keeps the command stable (``torchrun ... -m ckptflow.trainer.train``).
"""

from __future__ import annotations

from ckptflow.trainer.distenv import exit_process
from ckptflow.trainer.reference.job import main

if __name__ == "__main__":
    exit_process(main())
