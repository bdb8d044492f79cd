"""Phase 08 lab starters (generated; see each module's docstring)."""
