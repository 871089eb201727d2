import os
import sys
import tempfile

import pytest
import torch.distributed as dist

# Tests import the multi-process harness (tests/harness) as top-level modules, and the
# package from the checkout; local ranks take this sys.path (tools/local_ranks.py), subprocesses get it
# through PYTHONPATH (harness/fairseq_corpus.py sets it for fairseq-train).
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (os.path.join(HERE, "harness"), ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

# Every table sharded unless a test says otherwise: on the tests' tiny CPU models the
# default plan (--embrace-plan auto) may replicate them, and the tests of the sharded path
# would then test the stock one. Ranks and fairseq-train children inherit it; the tests of
# the plan itself pass --embrace-plan (or the DeepSpeed config's "plan") explicitly.
os.environ.setdefault("EMBRACE_PLAN", "shard")


@pytest.fixture
def gloo1():
    """A real gloo process group of one rank in this process, torn down after the test."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 's')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
