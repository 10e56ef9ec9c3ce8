"""``python -m engine ...``: see ``engine.cli``."""
from engine.cli import MODULE_COMMAND, main

raise SystemExit(main(prog=MODULE_COMMAND))
