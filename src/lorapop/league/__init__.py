"""The league: members' TrueSkill ratings, PFSP matchmaking, and replacement plans.

Knows member names and ratings only; no tensors (the loop applies plans to adapters).
"""

from lorapop.league.matchmaking import PFSPMode, match, pfsp_probabilities, pfsp_weight
from lorapop.league.ratings import MatchResult, Ratings, Role, TrueSkillParams, match_result
from lorapop.league.replacement import ChildRating, Replacement, plan_replacement, rate_children

__all__ = [
    "ChildRating",
    "MatchResult",
    "PFSPMode",
    "Ratings",
    "Replacement",
    "Role",
    "TrueSkillParams",
    "match",
    "match_result",
    "pfsp_probabilities",
    "pfsp_weight",
    "plan_replacement",
    "rate_children",
]
