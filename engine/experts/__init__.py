"""Mixture-of-experts routers: their load-balancing term over the global batch (``balance``,
``terms``, ``window``), Hugging Face models' own term (``hf``)."""

from engine.experts.terms import LoadBalancingLoss, load_balancing_loss

__all__ = ["LoadBalancingLoss", "load_balancing_loss"]
