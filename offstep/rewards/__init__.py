"""Rewards: rule-based scorers (``scorers.py``) and the scorer registry (``registry.py``)."""
