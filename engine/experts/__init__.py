"""Mixture-of-experts routers: their load-balancing term over the global batch (``balance``,
``terms``), Hugging Face models' own term (``hf``), aux-loss-free bias updates (``bias``). The
window's part that counts the routers before the backwards is ``engine.experts.window``."""

from engine.experts.terms import LoadBalancingLoss

__all__ = ["LoadBalancingLoss"]
