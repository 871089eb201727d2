"""fairseq adapter: glue that lets fairseq's own trainer and tools run EmbRace models.

Importing it (``--user-dir user_dir`` does) applies the compatibility fixes in
:mod:`.compat` and registers the EmbRace architectures. No algorithm lives here.
"""
