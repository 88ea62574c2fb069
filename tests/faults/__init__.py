"""The fault-injection suite (``pytest -m faults``): crashes, corruption, full disks and
I/O errors, misuse, resources. Its machinery is the shipped harness ``tiered_kv.testing``
(``harness``, ``crash``, ``storm_child``, ``ranks``); ``tools/fault_report.py`` runs the
same trials at scale."""
