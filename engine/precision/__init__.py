"""Mixed precision of the torch backend: the policy holders ask (``policy.py``), fp16's loss
scaler (``loss_scaler.py``) and the half-precision compute copy of a model held whole
(``compute_copy.py``). Master weights and optimizer state stay in the parameters' own dtype."""
