"""The fault-injection suite (``pytest -m faults``): crashes, corruption, full disks and
I/O errors, misuse, resources. Shared machinery lives in ``harness``; the crash child
in ``storm_child``; ``tools/fault_report.py`` runs the same trials at scale."""
