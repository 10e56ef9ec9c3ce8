"""Mixture-of-experts routers: their load-balancing term over the global batch (``balance``,
``terms``, ``window``), Hugging Face models' own term (``hf``)."""

from engine.experts.terms import LoadBalancingLoss

__all__ = ["LoadBalancingLoss"]
