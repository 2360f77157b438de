"""A stream's use of shared prefixes: the head's plan for its (re-)prefill (head/prefix_plans.py),
and how many prompt tokens a stored prefix covered."""

from __future__ import annotations

from .positions import Positions


class PrefixUse:
    __slots__ = ("plan", "planned", "may_open", "opened_tokens")

    def __init__(self):
        self.plan = None  # its PrefixPlan, made at its first step
        self.planned = False
        self.may_open = True  # False after a shard lacked the prefix: the re-prefill computes it
        self.opened_tokens = 0  # prompt tokens opened from a shared prefix

    def make(self, planner, principal: str, pos: Positions, keep: int) -> None:
        """At a (re-)prefill's first step: open from the longest shared prefix the head holds, and
        store the one to keep (PrefixPlanner.plan)."""
        self.planned = True
        self.plan = planner.plan(principal, pos.tokens, pos.computed, keep, self.may_open)
        if self.plan is not None and self.plan.open_tokens:
            pos.computed = self.plan.open_tokens

    def step_end(self, start: int, end: int) -> int:
        """Where a step from `start` ends: the step that stores a prefix ends with it."""
        plan = self.plan
        return min(end, plan.store_tokens) if plan is not None and plan.store_tokens > start else end

    def opening(self, start: int, first_step: bool) -> int:
        plan = self.plan
        return plan.open_tokens if plan is not None and first_step and start == plan.open_tokens else 0

    def storing(self, end: int, drafts: bool) -> int:
        plan = self.plan
        return plan.store_tokens if plan is not None and not drafts and end == plan.store_tokens else 0

    def opened(self) -> None:
        """The first step went through: the prompt tokens the plan opened count as the prefix's."""
        if self.plan is not None and self.plan.open_tokens:
            self.opened_tokens = self.plan.open_tokens

    def reset(self) -> None:
        self.planned, self.plan, self.opened_tokens = False, None, 0
