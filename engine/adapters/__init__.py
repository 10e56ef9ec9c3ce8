"""Framework internals Microstep relies on, one module per framework (``torch_internals``,
``deepspeed_internals``). Strategies reach private or version-dependent APIs only through
these, and each adapter checks, when a strategy is built, that the installed version is a
tested one and that every name it uses is present."""
