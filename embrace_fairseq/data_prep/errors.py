"""Errors raised by data preparation.

A failed download or an unexpected package layout must stop the run with a message that
names the package and the path that was expected, so the cause is clear without a traceback
through apt, pip or the HTML parser.
"""


class DataPrepError(RuntimeError):
    """Base class: anything that stops data preparation for a reason outside the code."""


class FetchError(DataPrepError):
    """`apt-get download`, `dpkg-deb -x` or `pip download` failed for a named package."""


class LayoutError(DataPrepError):
    """A downloaded package does not hold the files where they are expected."""


class ToolError(DataPrepError):
    """An external tool (fairseq-preprocess) is missing or failed."""
