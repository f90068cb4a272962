"""``python -m moveprobe``: run the sample app from its ``MOVEPROBE_*`` environment."""

from moveprobe.app import main

raise SystemExit(main())
