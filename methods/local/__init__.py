"""Local training: every client trains alone on its own data, the baseline a federation must beat."""
