"""Deterministic data preparation: LibreOffice help German->English and State of the Union English.

``python -m embrace_fairseq.data_prep --out data`` builds everything; the Python API is
`prepare_all`, `prepare_deen` and `prepare_lm`. See `pipeline` for the output layout.
"""
from embrace_fairseq.data_prep.errors import DataPrepError, FetchError, LayoutError, ToolError
from embrace_fairseq.data_prep.pipeline import prepare_all, prepare_deen, prepare_lm

__all__ = ["prepare_all", "prepare_deen", "prepare_lm",
           "DataPrepError", "FetchError", "LayoutError", "ToolError"]
