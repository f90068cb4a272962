"""``python -m sim ...`` is ``hostmove sim ...``."""

from sim.cli import main

raise SystemExit(main())
