"""`burst.cqs`, the contract's name (DESIGN.md) for CQS-Attention's covers and schedule.

They live in schedules/cqs.py (and the paper's own lists in schedules/cqs_paper.py).
"""

from .schedules.cqs import Schedule, interest_set, is_difference_cover, lower_bound, schedule, sequence_length_ratio

__all__ = ["Schedule", "interest_set", "is_difference_cover", "lower_bound", "schedule", "sequence_length_ratio"]
