"""Drop-in entry points for scripts written against other engines' APIs, over one
:class:`engine.Engine`: ``engine.compat.deepspeed`` and ``engine.compat.colossalai``
(see docs/migrating.md). Imported on demand: ``import engine`` does not load them."""
