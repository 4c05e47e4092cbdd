"""The one-command demo (``ckptflow demo``): real processes, started and stopped by PID."""
