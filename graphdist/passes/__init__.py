"""Graph -> Graph passes; each pure, each with its own tests."""

from graphdist.passes.core import run_passes, substitute
from graphdist.passes.cse import eliminate_common_subexpressions
from graphdist.passes.dce import eliminate_dead_code
from graphdist.passes.place import place
from graphdist.passes.schedule import liveness, schedule

__all__ = ["run_passes", "substitute", "eliminate_common_subexpressions",
           "eliminate_dead_code", "place", "liveness", "schedule"]
