"""Schedule: the 2D communication schedule as a pure plan (:mod:`.plan`), the rates its
static list is simulated with, measured on the ranks (:mod:`.rates`), and the executor
that issues dense all-reduce pieces during backward, by a live priority queue the ranks
agree on or by the static list (:mod:`.executor`). The plan is plain Python, computed the
same on every rank."""
