import os
import sys

# Tests import the multi-process harness (tests/harness) as top-level modules, and the
# package from the checkout; spawned ranks inherit this sys.path, subprocesses get it
# through PYTHONPATH (harness/fairseq_corpus.py sets it for fairseq-train).
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (os.path.join(HERE, "harness"), ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)
