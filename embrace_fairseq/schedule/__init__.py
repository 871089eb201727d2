"""Schedule: the 2D communication schedule as a pure plan (:mod:`.plan`) and the
executor that issues dense all-reduce pieces in that order during backward
(:mod:`.executor`). The plan is plain Python, computed the same on every rank."""
