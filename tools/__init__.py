"""Tools beside the packages, not part of a run: speed benchmarks (`speed_*.py`, each timing one pipeline against its
own bound or peer), the per-GPU memory plan (`memory_plan.py`) and the profiler trace report (`profile_report.py`)."""
