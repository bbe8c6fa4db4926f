"""Token-selection policies: which positions of an assembled prompt get recomputed."""

from sgl_pic.selection.base import (
    Selection,
    SelectionContext,
    SelectionPolicy,
    as_selection,
    finalize,
)
from sgl_pic.selection.cachetune import cachetune_ranking, ranking_recipe
from sgl_pic.selection.daric import DaricBudget, daric_budget, daric_select, mtaf_values
from sgl_pic.selection.registry import make_policy, policy_names, register_policy

__all__ = [
    "DaricBudget",
    "Selection",
    "SelectionContext",
    "SelectionPolicy",
    "as_selection",
    "cachetune_ranking",
    "daric_budget",
    "daric_select",
    "finalize",
    "make_policy",
    "mtaf_values",
    "policy_names",
    "ranking_recipe",
    "register_policy",
]
