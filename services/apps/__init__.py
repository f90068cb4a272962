"""App releases (issue 18): any SQLite-backed app a platform's users bring, published as a release and rendered by
every box for every start of its instances (:mod:`.manifest` pure, :mod:`.releases` the store, :mod:`.box` a box's
renderer)."""
