"""Tools: :mod:`.local_ranks` (start N real gloo ranks as processes on this machine)
and :mod:`.fault_report` (runs the fault scenarios and writes docs/RELIABILITY.md)."""
