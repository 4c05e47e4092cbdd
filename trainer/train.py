"""``python -m ckptflow.trainer.train``: the documented, stable command of the reference job (under torchrun).
The job itself, an example user of the library, lives in ``reference/job.py``.
"""

from __future__ import annotations

from ckptflow.trainer.distenv import exit_process
from ckptflow.trainer.reference.job import main

if __name__ == "__main__":
    exit_process(main())
