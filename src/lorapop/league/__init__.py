"""The league: members' TrueSkill ratings, PFSP matchmaking, replacement plans, lineages.

Knows member names, ratings and lineages only; no tensors (the loop applies plans to
adapters).
"""

from lorapop.league.lineage import Lineage, individual_id
from lorapop.league.matchmaking import PFSPMode, match, pfsp_probabilities, pfsp_weight
from lorapop.league.ratings import (
    MatchResult,
    Ratings,
    Role,
    TrueSkillParams,
    match_result,
    match_results,
)
from lorapop.league.replacement import ChildRating, Replacement, plan_replacement, rate_children

__all__ = [
    "ChildRating",
    "Lineage",
    "MatchResult",
    "PFSPMode",
    "Ratings",
    "Replacement",
    "Role",
    "TrueSkillParams",
    "individual_id",
    "match",
    "match_result",
    "match_results",
    "pfsp_probabilities",
    "pfsp_weight",
    "plan_replacement",
    "rate_children",
]
