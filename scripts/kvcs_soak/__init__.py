"""make soak: real P/D servers under load and real races, judged against ground truth (docs/soak.md)."""
