"""fairseq ``--user-dir`` plugin for EmbRace: ``fairseq-train --user-dir user_dir ...``.

Thin on purpose: everything lives in :mod:`embrace_fairseq.fairseq_adapter`.
"""
import embrace_fairseq.fairseq_adapter  # noqa: F401  (fixes + registrations)
