"""What a move carries between boxes: the sealed archive (§8), the files manifest (L17) and the generation
markers (``generation.json``, ``.gen``, ``.files-gen``) that say which files belong to which generation."""
