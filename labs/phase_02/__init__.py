"""Phase 02 lab starters (generated; see each module's docstring)."""
