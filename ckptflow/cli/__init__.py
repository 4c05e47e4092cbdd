"""The ``ckptflow`` command line. Each command lives in its own ``cmd_*`` module and
imports heavy libraries (torch, prefect, great_expectations) inside the function, so
``ckptflow --help`` and light commands start in well under a second."""
